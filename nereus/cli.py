"""The ``nereus`` command line: a thin layer over the Python API.

Exit codes (docs/ARCHITECTURE.md, "the command line"): 0 success; 1 diagnostics (or ``fmt --check`` found a difference);
2 usage errors (argparse). Bad input never prints a traceback: every error a user can cause
is a diagnostic ``FILE:LINE:COL: error: MESSAGE`` with the source line and a caret.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .ir import Diagnostic, DiagnosticError, Loc, bare_name, parse, print_ir, verify
from .ir.diagnostics import plural


def _load(path: str):
    """Read, parse and verify one file; raises DiagnosticError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DiagnosticError([Diagnostic(Loc(0, 0, path), "no such file")]) from None
    except IsADirectoryError:
        raise DiagnosticError([Diagnostic(Loc(0, 0, path), "is a directory, not a .nir file")]) from None
    except UnicodeDecodeError as e:
        raise DiagnosticError([Diagnostic(Loc(0, 0, path), f"not UTF-8 text ({e.reason} at byte {e.start})")]) from None
    except OSError as e:
        raise DiagnosticError([Diagnostic(Loc(0, 0, path), f"cannot read: {e.strerror}")]) from None
    from .ir.verifier import require_declarations  # an empty file is an error, not a silent success

    return require_declarations(verify(parse(text, path))), text


def _modules(paths: list[str]):
    """(path, module, text) per file; module and text are None for a file whose diagnostics were reported."""
    for path in paths:
        try:
            m, text = _load(path)
        except DiagnosticError as e:
            _report(e)
            yield path, None, None
            continue
        yield path, m, text


def _write(path: str, text: str) -> bool:
    """Write an output file; a path that cannot be written is a diagnostic (False), not a traceback."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        _report(DiagnosticError([Diagnostic(Loc(0, 0, path), f"cannot write: {e.strerror}")]))
        return False
    return True


def _report(err: DiagnosticError) -> None:
    print(err.render(), file=sys.stderr)
    n = len(err.diagnostics)
    print(f"{n} error{'s' if n != 1 else ''}", file=sys.stderr)


def cmd_check(args) -> int:
    from .ir.plausible import unit_warnings
    from .ir.verifier import batch_warnings

    failed = []
    for path, m, text in _modules(args.files):
        if m is None:
            failed.append(path)
            continue
        # valid IR, but a figure whose unit looks like a slip, or a split a framework would not run
        for w in unit_warnings(m) + batch_warnings(m):
            print(w.render(text), file=sys.stderr)
    return 1 if failed else 0


def cmd_fmt(args) -> int:
    status = 0
    for path, m, text in _modules(args.files):
        if m is None:
            status = 1
            continue
        canonical = print_ir(m)
        if args.check:
            if canonical != text:
                print(f"{path}: not in canonical form (run: nereus fmt {path})", file=sys.stderr)
                status = 1
        elif args.stdout:
            sys.stdout.write(canonical)
        elif canonical != text:
            if not _write(path, canonical):
                status = 1
                continue
            print(f"formatted {path}")
    return status


def cmd_show(args) -> int:
    from .show import show

    status = 0
    for path, m, _ in _modules(args.files):
        if m is None:
            status = 1
            continue
        show(m, path, breakdown=args.breakdown)
    return status


def cmd_diff(args) -> int:
    """Two plans side by side: of one file (its two plans, or --plans) or of two files."""
    from .show import diff

    if len(args.files) > 2:
        print(f"nereus diff: error: give one file with two plans or two files, not {len(args.files)}", file=sys.stderr)
        return 1
    loaded = [(path, _load(path)[0]) for path in args.files]
    (pa, ma), (pb, mb) = loaded[0], loaded[-1]
    if args.plans:
        a, b = (bare_name(x) for x in args.plans)
    elif len(loaded) == 1:
        if len(ma.plans) != 2:
            print(
                f"nereus diff: error: {pa} has {plural(len(ma.plans), 'plan')} "
                f"({', '.join('@' + n for n in ma.plans) or 'none'}); "
                "name two with --plans @a @b",
                file=sys.stderr,
            )
            return 1
        a, b = ma.plans
    else:
        many = [(p, m) for p, m in loaded if len(m.plans) != 1]
        if many:
            p, m = many[0]
            print(
                f"nereus diff: error: {p} has {plural(len(m.plans), 'plan')} "
                f"({', '.join('@' + n for n in m.plans) or 'none'}); "
                "name one of each file with --plans @a @b",
                file=sys.stderr,
            )
            return 1
        a, b = next(iter(ma.plans)), next(iter(mb.plans))
    for path, m, name in ((pa, ma, a), (pb, mb, b)):
        if name not in m.plans:
            print(
                f"nereus diff: error: {path} has no plan @{name}; its plans: "
                + (", ".join("@" + n for n in m.plans) or "none"),
                file=sys.stderr,
            )
            return 1
    where = pa if len(loaded) == 1 else f"{pa} vs {pb}"
    diff(ma, a, mb, b, f"{where}: @{a} -> @{b}")
    return 0


def cmd_replan(args) -> int:
    """What the live controller would decide if the job changed now (``control/what_if.py``)."""
    from .control import ControlOptions
    from .control.what_if import Change, what_if
    from .show import show_decision

    text = Path(args.file).read_text(encoding="utf-8") if Path(args.file).is_file() else None
    if text is None:
        _load(args.file)  # its error
    change = Change(
        lose=tuple(args.lose or ()), leave=tuple(args.leave or ()), join=args.join, sets=tuple(args.set), step=args.step
    )
    options = ControlOptions(search_time_limit=args.time_limit, seed=args.seed)
    with stdout_to_stderr(args.json):
        decision, _ = what_if(parse(text, args.file), args.plan, change, options)
    if args.output and decision.module is not None:
        _write(args.output, print_ir(decision.module))
    if args.json:
        print(json.dumps(decision.to_json(), indent=1, sort_keys=True))
    else:
        show_decision(decision, change.notes)
    return 0 if decision.action != "infeasible" else 2


def cmd_opt(args) -> int:
    from .registry import run_pipeline

    m, _ = _load(args.file)

    def dump(p, module):
        print(f"// ----- IR after {p.name}", file=sys.stderr)
        print(print_ir(module), end="", file=sys.stderr)

    passes = args.pipeline
    if passes is None:  # the file's own // RUN: line, as the golden tests run it
        from .testing.golden import run_header

        try:
            passes = run_header(m.source or "", piped=True)
        except ValueError as e:
            print(f"nereus opt: error: {args.file}: give -p PIPELINE: {e}", file=sys.stderr)
            return 1
    if args.explain:  # every pass that can explain itself does
        from dataclasses import fields, replace

        from .registry import parse_pipeline

        passes = [
            replace(p, explain=True) if any(f.name == "explain" for f in fields(p)) else p
            for p in parse_pipeline(passes)
        ]
    run_pipeline(
        m, passes, after_each=dump if args.print_ir_after_all else None, verify_input=False
    )  # _load verified it
    for w in m.warnings:
        if w.loc.file is None:
            w = Diagnostic(Loc(w.loc.line, w.loc.col, args.file), w.message, w.hint, w.severity)
        print(w.render(m.source), file=sys.stderr)
    for line in m.explanations:
        print(line, file=sys.stderr)
    text = print_ir(m)
    if args.golden:
        from .testing.golden import GoldenMismatch, compare

        try:
            compare(text, Path(args.golden), args.update_goldens)
        except GoldenMismatch as e:
            print(f"nereus opt: {e}", file=sys.stderr)
            return 1
        print(f"{args.golden}: matches")
        return 0
    if args.output:
        return 0 if _write(args.output, text) else 1
    else:
        sys.stdout.write(text)
    return 0


def cmd_lower(args) -> int:
    from .backend.lower import lower, pick_transition
    from .backend.program import print_program
    from .backend.script import render_script
    from .backend.summary import format_summary, summarize
    from .registry import run_pipeline

    m, _ = _load(args.file)
    if args.pipeline:
        run_pipeline(m, args.pipeline)
    prog = lower(
        m,
        pick_transition(m, args.transition or ""),
        bucket_bytes=args.bucket,
        broadcast=args.broadcast,
        direct_bytes=args.direct,
    )
    if args.script:
        if not _write(args.script, render_script(prog)):
            return 1
        print(f"{args.script}: torchrun --nproc-per-node {prog.world} {args.script} --selftest", file=sys.stderr)
    elif args.full:
        sys.stdout.write(print_program(prog, fold=True))
    else:
        t = m.transitions[prog.transition]
        sys.stdout.write(format_summary(summarize(prog, m.clusters[m.plans[t.target].cluster], t.makespan)))
    return 0


def cmd_launch(args) -> int:
    from .runtime.launcher import launch

    if not args.command_line:
        print(
            "nereus launch: give the script to run, e.g. nereus launch --nproc 4 train.py --steps 10", file=sys.stderr
        )
        return 2
    try:
        return launch(
            args.command_line,
            args.nproc,
            join=args.join,
            master=args.master,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            linger=args.linger,
        )
    except ValueError as e:
        print(f"nereus launch: {e}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def stdout_to_stderr(on: bool = True):
    """While the block runs, stdout is stderr, for ``sys.stdout`` and for file descriptor 1: what
    prints (this process, C libraries, logging handlers that took ``sys.stdout`` at import, as
    vLLM's do, and processes started meanwhile, which inherit descriptor 1) goes to stderr, so
    that a ``--json`` command's stdout holds its one JSON document and nothing else."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_bench(args) -> int:
    from .bench import BENCHMARKS, run

    if args.name not in BENCHMARKS:
        print(f"nereus bench: unknown benchmark '{args.name}'; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 1
    with stdout_to_stderr(args.json):
        result = run(args.name, quick=args.quick, json_output=args.json)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _size(text: str) -> int:
    """A size option: ``64MiB`` or a plain number of bytes (argparse reports a bad one)."""
    from .ir.units import UnitError, parse_size

    try:
        return parse_size(text)
    except UnitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gpus(text: str) -> list[int]:
    """``8..15``, ``3,5`` or ``0..3,8``: GPU ids."""
    out: list[int] = []
    try:
        for part in text.replace(" ", "").strip("[]").split(","):
            lo, _, hi = part.partition("..")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"GPUs are ids and ranges, e.g. 8..15 or 3,5; got {text!r}") from None
    return out


def _truths(text: str) -> str:
    """``event`` or ``event,hidden,...``: each a truth of the simulator (argparse reports a bad one)."""
    from .sim.simulated_cluster import TRUTHS

    bad = [t for t in text.split(",") if t not in TRUTHS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown truth {bad[0]!r}; truths: {', '.join(TRUTHS)}")
    return text


def _trace_job(trace, path: str):
    """The IR job a trace names: an example of ``nereus.testing.jobs`` or a .nir file beside the trace."""
    from .testing.jobs import EXAMPLES

    name = trace.job if trace.job.endswith(".nir") else f"{trace.job}.nir"
    beside = Path(path).parent / name
    if beside.exists():
        return _load(str(beside))[0]
    if name in EXAMPLES:
        return verify(parse(EXAMPLES[name](), name))
    raise DiagnosticError(
        [
            Diagnostic(
                Loc(1, 1, path),
                f"the trace's job '{trace.job}' is neither an example nor a file beside the trace",
                "examples: " + ", ".join(EXAMPLES),
            )
        ]
    )


def cmd_simulate(args) -> int:
    from .sim.report import plots, table, to_json
    from .sim.simulate import simulate_traces
    from .sim.trace import read_trace

    cases = []
    for path in args.trace:
        try:
            trace = read_trace(path)
        except FileNotFoundError:
            raise DiagnosticError([Diagnostic(Loc(0, 0, path), "no such file")]) from None
        cases += [(_trace_job(trace, path), trace, truth) for truth in args.truth.split(",")]
    policies = args.policies.split(",") if args.policies else None
    with stdout_to_stderr(args.json):
        results = simulate_traces(
            cases,
            policies,
            steps=args.steps,
            seed=args.seed,
            progress=not args.json,
            jobs=args.jobs,
        )
    if args.json:  # one trace: its document; several: one document holding theirs
        docs = [to_json(r) for r in results]
        whole = docs[0] if len(docs) == 1 else {"wall_s": results[0]["wall_s"], "traces": docs}
        print(json.dumps(whole, indent=1))
    else:
        for result in results:
            table(result)
    if args.plot:
        for result in results:
            gantt = getattr(result["policies"].get("nereus"), "example", None)
            for f in plots(result, args.plot, gantt):
                print(f"wrote {f}", file=sys.stderr)
    return 0


def cmd_import_hf(args) -> int:
    from .ir.hf_config import hf_notes, load_hf_config, model_block, model_from_hf_config
    from .ir.presets import PRESET_NOTES, PRESETS, preset_attrs, preset_model

    if args.list_presets:
        for name in PRESETS:
            print(f"{name:12} {preset_model(name).num_params() / 1e9:6.2f} B  {preset_attrs(name)}")
        return 0
    if (args.config is None) == (args.preset is None):
        print("nereus import-hf: error: give CONFIG.json or --preset NAME (--list-presets lists them)", file=sys.stderr)
        return 2
    if args.preset:
        if args.preset not in PRESETS:
            print(
                f"nereus import-hf: error: unknown preset '{args.preset}'; presets: {', '.join(PRESETS)}",
                file=sys.stderr,
            )
            return 1
        model = preset_model(args.preset, args.name, trained=args.trained, head=args.head)
        notes = PRESET_NOTES.get(args.preset, [])
    else:
        cfg, _ = load_hf_config(args.config)
        model = model_from_hf_config(args.config, args.name, trained=args.trained, head=args.head)
        notes = hf_notes(cfg, model)
    for n in notes:
        print(f"nereus import-hf: note: {n}", file=sys.stderr)
    sys.stdout.write(model_block(model))
    return 0


def cmd_export(args) -> int:
    from .export import export_plan

    m, _ = _load(args.file)
    text = export_plan(m, args.plan, args.to)
    for line in text.splitlines():  # what the framework runs differs from the plan (``export.as_run``)
        if line.startswith("# warning: "):
            print(f"nereus export: warning: {line.removeprefix('# warning: ')}", file=sys.stderr)
    if args.output:
        return 0 if _write(args.output, text) else 1
    sys.stdout.write(text)
    return 0


def cmd_passes(args) -> int:
    from .passes.infra.pass_manager import option_type, pipeline_options
    from .registry import get_all_passes

    for name, cls in get_all_passes().items():
        doc = " ".join((cls.__doc__ or "").split())
        print(f"{name}  ({cls.__module__})")
        for f in pipeline_options(cls):
            print(f"    {f.name}: {option_type(cls, f.name)} = {f.default!r}")
        if doc:
            print(f"    -- {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .backend.lower import DEFAULT_BUCKET, DEFAULT_DIRECT
    from .bench import BENCHMARKS
    from .sim import POLICY_NAMES

    p = argparse.ArgumentParser(prog="nereus", description="Adaptive parallelism for RL post-training: IR tools.")
    p.add_argument("--version", action="version", version=f"nereus {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("check", help="parse and verify .nir files")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.set_defaults(func=cmd_check)
    f = sub.add_parser("fmt", help="rewrite .nir files in canonical form")
    f.add_argument("files", nargs="+", metavar="FILE")
    f.add_argument("--check", action="store_true", help="only check; exit 1 if a file would change")
    f.add_argument("--stdout", action="store_true", help="print the canonical form instead of rewriting")
    f.set_defaults(func=cmd_fmt)
    s = sub.add_parser("show", help="summarise a module: GPUs, model-stages, layouts, memory")
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument(
        "--breakdown", action="store_true", help="each model-stage's time and memory by component (docs/IR.md)"
    )
    s.set_defaults(func=cmd_show)
    d = sub.add_parser(
        "diff", help="two plans side by side: layouts, times and memory, with the change (estimated if needed)"
    )
    d.add_argument("files", nargs="+", metavar="FILE", help="one file with two plans, or two files")
    d.add_argument("--plans", nargs=2, metavar=("@A", "@B"), help="which plans (of the first file, and of the second)")
    d.set_defaults(func=cmd_diff)
    r = sub.add_parser(
        "replan",
        help="what if the job changed: plan B, the move and its cost, and the decision the live controller would make",
    )
    r.add_argument("file", metavar="FILE")
    r.add_argument("--plan", required=True, metavar="@NAME", help="the running plan")
    r.add_argument("--lose", type=_gpus, metavar="GPUS", help="GPUs gone without notice, e.g. 8..15 or 3,5")
    r.add_argument("--leave", type=_gpus, metavar="GPUS", help="GPUs announced to leave (they still send their state)")
    r.add_argument("--join", type=int, default=0, metavar="N", help="N GPUs join (unavailable ones first, then nodes)")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="BLOCK.FIELD=VALUE",
        help="a workload or cluster field as it is now, e.g. workload.response_len_max=16384 (repeatable)",
    )
    r.add_argument("--step", type=int, default=0, help="steps done: the rest of the workload's steps is the horizon")
    r.add_argument("--time-limit", type=float, default=5.0, help="plan-search's time limit (s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print the decision as JSON (as the decision log writes it)")
    r.add_argument("-o", "--output", metavar="OUT", help="write the job with plans A and B and the transition here")
    r.set_defaults(func=cmd_replan)
    o = sub.add_parser("opt", help="run a pipeline of passes and print the resulting IR")
    o.add_argument("file", metavar="FILE")
    o.add_argument(
        "-p", "--pipeline", help="e.g. derive-emus{model_stage=actor.train} (default: the file's // RUN: line)"
    )
    o.add_argument(
        "--explain",
        action="store_true",
        help="passes that can explain their choices do (plan-search: runner-ups, bottleneck, memory, colocation, "
        "offload; to stderr)",
    )
    o.add_argument("-o", "--output", metavar="OUT", help="write the IR here instead of stdout")
    o.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (to stderr)")
    o.add_argument(
        "--golden",
        metavar="FILE.expected",
        help="compare the result with a golden file (exit 1 and a diff if it differs)",
    )
    o.add_argument(
        "--update-goldens", action="store_true", help="with --golden: rewrite the golden file (still exit 1)"
    )
    o.set_defaults(func=cmd_opt)
    lo = sub.add_parser(
        "lower", help="lower a transition to a collective program; summarise or print it, or render a script"
    )
    lo.add_argument("file", metavar="FILE")
    lo.add_argument("-p", "--pipeline", help="passes to run first, e.g. plan-transition{to=@b},schedule-transfers")
    lo.add_argument("--transition", metavar="@NAME", help="which transition (default: the only one)")
    lo.add_argument("--script", metavar="OUT.py", help="write a standalone Python script that runs under torchrun")
    lo.add_argument(
        "--full",
        action="store_true",
        help="print the whole program (per-layer repetition folded into layers.A..B ranges) instead of its summary",
    )
    lo.add_argument(
        "--bucket",
        type=_size,
        default=DEFAULT_BUCKET,
        metavar="SIZE",
        help="bucket size for packed slices, with a unit (64MiB) or in bytes",
    )
    lo.add_argument(
        "--direct",
        type=_size,
        default=DEFAULT_DIRECT,
        metavar="SIZE",
        help="a slice at least this large that is contiguous on one side travels as its own message (default 64KiB)",
    )
    lo.add_argument(
        "--broadcast",
        choices=("auto", "p2p", "chain", "collective"),
        default="auto",
        help="send one slice to many as point-to-point messages or as a subgroup broadcast",
    )
    lo.set_defaults(func=cmd_lower)
    ps = sub.add_parser("passes", help="list every pass with its options, their types and defaults")
    ps.set_defaults(func=cmd_passes)
    sm = sub.add_parser("simulate", help="run the policies side by side on traces (nereus/sim/traces/*.jsonl)")
    sm.add_argument(
        "trace",
        metavar="TRACE",
        nargs="+",
        help="trace files (JSON lines, nereus/sim/trace.py); several run in one pool of --jobs processes",
    )
    sm.add_argument("--policies", help=f"comma-separated: {', '.join(POLICY_NAMES)} (default: all)")
    sm.add_argument("--steps", type=int, help="simulate only the first N steps")
    sm.add_argument("--seed", type=int, default=0, help="noise and stragglers")
    sm.add_argument(
        "--truth",
        type=_truths,
        default="event",
        help="what a plan really costs, or several, comma-separated (each trace runs under each): "
        "the step played out event by event (event: nereus/sim/truth); "
        "the event truth with errors no cost model knows of: per-configuration hidden factors (hidden), "
        "decode 20%% slower at long contexts (long-gen), cross-node DP collectives 30%% slower "
        "(slow-inter), a spine oversubscribed 1:7 above 32-node pods (oversubscribed); "
        "or the cost model at hidden coefficients (formula: fast, but the planner's own form)",
    )
    sm.add_argument("--json", action="store_true", help="print the results as one JSON object")
    sm.add_argument("--plot", metavar="DIR", help="write step latency and a transition's Gantt chart as PNGs")
    sm.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="run the policies (of every trace) in this many processes (default: one per CPU)",
    )
    sm.set_defaults(func=cmd_simulate)
    la = sub.add_parser(
        "launch",
        help="start a job's workers as torchrun does, but a worker that dies does not stop the others, "
        "and --join adds workers to a running job",
    )
    la.add_argument("--nproc", "--nproc-per-node", type=int, default=1, help="workers on this node (default 1)")
    la.add_argument("--join", metavar="HOST:PORT", help="the workers join the running job whose store is there")
    la.add_argument("--master", metavar="HOST:PORT", help="the job's store (default: here, a free port)")
    la.add_argument("--nnodes", type=int, default=1, help="nodes that start the job (each runs nereus launch)")
    la.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 hosts the store")
    la.add_argument("--linger", type=float, default=5.0, help="seconds of no heartbeat before the store goes")
    la.add_argument("command_line", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS", help="script.py and its arguments")
    la.set_defaults(func=cmd_launch)
    b = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("name", metavar="NAME", help=", ".join(BENCHMARKS))
    b.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    b.set_defaults(func=cmd_bench)
    hf = sub.add_parser("import-hf", help="print a model block from a Hugging Face config.json or a public preset")
    hf.add_argument("config", nargs="?", metavar="CONFIG.json", help="a Llama, Qwen2 or Mistral config.json")
    hf.add_argument("--preset", metavar="NAME", help="a public model shape instead (--list-presets)")
    hf.add_argument("--list-presets", action="store_true", help="list the presets with their parameter counts")
    hf.add_argument("--name", default="actor", help="the model's IR name (default: actor)")
    hf.add_argument("--trained", action="store_true", help="the job updates this model (actor, critic)")
    hf.add_argument("--head", choices=("lm", "value"), default="lm", help="value: a scalar head (critic, reward)")
    hf.set_defaults(func=cmd_import_hf)
    ex = sub.add_parser("export", help="write a plan as verl config, Megatron-LM arguments or vLLM engine arguments")
    ex.add_argument("file", metavar="FILE")
    ex.add_argument("--plan", required=True, metavar="@NAME", help="the plan to export")
    ex.add_argument(
        "--to",
        required=True,
        choices=("verl", "verl-overrides", "megatron", "vllm"),
        help="verl YAML, verl Hydra overrides (key=value), Megatron-LM arguments, vLLM engine arguments",
    )
    ex.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    ex.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    from .passes import PipelineError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DiagnosticError as e:  # every command's diagnostics, reported here once
        _report(e)
        return 1
    except PipelineError as e:
        print(f"nereus {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except BrokenPipeError:  # the reader went away (nereus passes | head): nothing left to say
        sys.stderr.close()
        return 0
