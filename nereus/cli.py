"""The ``nereus`` command line: a thin layer over the Python API.

Exit codes (docs/ARCHITECTURE.md, "the command line"): 0 success; 1 diagnostics (or ``fmt --check`` found a difference);
2 usage errors (argparse). Bad input never prints a traceback: every error a user can cause
is a diagnostic ``FILE:LINE:COL: error: MESSAGE`` with the source line and a caret.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .ir import Diagnostic, DiagnosticError, Loc, parse, print_ir, verify


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
    return verify(parse(text, path)), text


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
    failed = [path for path, m, _ in _modules(args.files) if m is None]
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
        show(m, path)
    return status


def cmd_opt(args) -> int:
    from .passes import PipelineError
    from .registry import run_pipeline

    try:
        m, _ = _load(args.file)
    except DiagnosticError as e:
        _report(e)
        return 1

    def dump(p, module):
        print(f"// ----- IR after {p.name}", file=sys.stderr)
        print(print_ir(module), end="", file=sys.stderr)

    try:
        run_pipeline(m, args.pipeline, after_each=dump if args.print_ir_after_all else None)
    except PipelineError as e:
        print(f"nereus opt: error: {e}", file=sys.stderr)
        return 1
    except DiagnosticError as e:
        _report(e)
        return 1
    for w in m.warnings:
        if w.loc.file is None:
            w = Diagnostic(Loc(w.loc.line, w.loc.col, args.file), w.message, w.hint, w.severity)
        print(w.render(m.source), file=sys.stderr)
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
    from .passes import PipelineError
    from .registry import run_pipeline

    try:
        m, _ = _load(args.file)
        if args.pipeline:
            run_pipeline(m, args.pipeline)
        prog = lower(m, pick_transition(m, args.transition or ""), bucket_bytes=args.bucket, broadcast=args.broadcast,
                     direct_bytes=args.direct)
    except PipelineError as e:
        print(f"nereus lower: error: {e}", file=sys.stderr)
        return 1
    except DiagnosticError as e:
        _report(e)
        return 1
    if args.script:
        if not _write(args.script, render_script(prog)):
            return 1
        print(f"{args.script}: torchrun --nproc-per-node {prog.world} {args.script} --selftest", file=sys.stderr)
    else:
        sys.stdout.write(print_program(prog))
    return 0


def cmd_bench(args) -> int:
    from .bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        print(f"nereus bench: unknown benchmark '{args.name}'; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 1
    result = BENCHMARKS[args.name](quick=args.quick, json_output=args.json)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _size(text: str) -> int:
    """A size option: ``64MiB`` or a plain number of bytes (argparse reports a bad one)."""
    from .ir.units import Dim, UnitError, parse_quantity

    if text.isdigit():
        return int(text)
    try:
        dim, value = parse_quantity(text)
    except UnitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if dim is not Dim.SIZE or value != int(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (64MiB, 1GiB or bytes)")
    return int(value)


def _trace_job(trace, path: str):
    """The IR job a trace names: an example of ``nereus.testing.jobs`` or a .nir file beside the trace."""
    from .testing.jobs import EXAMPLES

    name = trace.job if trace.job.endswith(".nir") else f"{trace.job}.nir"
    beside = Path(path).parent / name
    if beside.exists():
        return _load(str(beside))[0]
    if name in EXAMPLES:
        return verify(parse(EXAMPLES[name](), name))
    raise DiagnosticError([Diagnostic(Loc(1, 1, path), f"the trace's job '{trace.job}' is neither an example nor a file "
                                                       f"beside the trace", "examples: " + ", ".join(EXAMPLES))])


def cmd_simulate(args) -> int:
    from .sim.policies import POLICIES
    from .sim.report import plots, table, to_json
    from .sim.simulate import simulate
    from .sim.trace import read_trace

    try:
        trace = read_trace(args.trace)
        module = _trace_job(trace, args.trace)
        policies = args.policies.split(",") if args.policies else list(POLICIES)
        result = simulate(module, trace, policies, steps=args.steps, seed=args.seed, progress=not args.json)
    except FileNotFoundError:
        _report(DiagnosticError([Diagnostic(Loc(0, 0, args.trace), "no such file")]))
        return 1
    except DiagnosticError as e:
        _report(e)
        return 1
    if args.json:
        print(json.dumps(to_json(result), indent=1))
    else:
        table(result)
    if args.plot:
        gantt = getattr(result["policies"].get("nereus"), "example", None)
        for f in plots(result, args.plot, gantt):
            print(f"wrote {f}", file=sys.stderr)
    return 0


def cmd_passes(args) -> int:
    import dataclasses

    from .passes.pass_manager import option_type
    from .registry import get_all_passes

    for name, cls in get_all_passes().items():
        doc = " ".join((cls.__doc__ or "").split())
        print(f"{name}  ({cls.__module__})")
        for f in dataclasses.fields(cls):
            print(f"    {f.name}: {option_type(cls, f.name)} = {f.default!r}")
        if doc:
            print(f"    -- {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .backend.lower import DEFAULT_BUCKET, DEFAULT_DIRECT

    p = argparse.ArgumentParser(prog="nereus", description="Adaptive parallelism for RL post-training: IR tools.")
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
    s.set_defaults(func=cmd_show)
    o = sub.add_parser("opt", help="run a pipeline of passes and print the resulting IR")
    o.add_argument("file", metavar="FILE")
    o.add_argument("-p", "--pipeline", required=True, help="e.g. derive-emus{model_stage=actor.train}")
    o.add_argument("-o", "--output", metavar="OUT", help="write the IR here instead of stdout")
    o.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (to stderr)")
    o.add_argument("--golden", metavar="FILE.expected", help="compare the result with a golden file (exit 1 and a diff if it differs)")
    o.add_argument("--update-goldens", action="store_true", help="with --golden: rewrite the golden file (still exit 1)")
    o.set_defaults(func=cmd_opt)
    lo = sub.add_parser("lower", help="lower a transition to a collective program; print it or render a script")
    lo.add_argument("file", metavar="FILE")
    lo.add_argument("-p", "--pipeline", help="passes to run first, e.g. plan-transition{to=@b},schedule-transfers")
    lo.add_argument("--transition", metavar="@NAME", help="which transition (default: the only one)")
    lo.add_argument("--script", metavar="OUT.py", help="write a standalone Python script that runs under torchrun")
    lo.add_argument("--bucket", type=_size, default=DEFAULT_BUCKET, metavar="SIZE",
                    help="bucket size for packed slices, with a unit (64MiB) or in bytes")
    lo.add_argument("--direct", type=_size, default=DEFAULT_DIRECT, metavar="SIZE",
                    help="a slice at least this large that is contiguous on one side travels as its own message "
                         "(default 64KiB)")
    lo.add_argument("--broadcast", choices=("auto", "p2p", "chain", "collective"), default="auto",
                    help="send one slice to many as point-to-point messages or as a subgroup broadcast")
    lo.set_defaults(func=cmd_lower)
    ps = sub.add_parser("passes", help="list every pass with its options, their types and defaults")
    ps.set_defaults(func=cmd_passes)
    sm = sub.add_parser("simulate", help="run the policies side by side on a trace (nereus/sim/traces/*.jsonl)")
    sm.add_argument("trace", metavar="TRACE", help="a trace file (JSON lines, nereus/sim/trace.py)")
    sm.add_argument("--policies", help="comma-separated: fixed, verl, openrlhf, nereus, oracle (default: all)")
    sm.add_argument("--steps", type=int, help="simulate only the first N steps")
    sm.add_argument("--seed", type=int, default=0, help="noise and stragglers")
    sm.add_argument("--json", action="store_true", help="print the results as one JSON object")
    sm.add_argument("--plot", metavar="DIR", help="write step latency and a transition's Gantt chart as PNGs")
    sm.set_defaults(func=cmd_simulate)
    b = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("name", metavar="NAME", help="parse, estimate, plan-search, transition, reshard, calibrate, controller or push")
    b.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DiagnosticError as e:  # pragma: no cover - commands report their own
        _report(e)
        return 1
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except BrokenPipeError:  # the reader went away (nereus passes | head): nothing left to say
        sys.stderr.close()
        return 0
