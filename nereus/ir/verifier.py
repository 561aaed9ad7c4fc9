"""Semantic rules of the IR: every rule a user can break, reported at the offending line.

``verify`` collects every error and raises one ``DiagnosticError``. Rules that need a
referenced declaration are skipped when that declaration is missing (the missing reference
is the error), so one typo does not produce a cascade.
"""

from __future__ import annotations

from .attributes import compress_ints
from .diagnostics import Diagnostic, DiagnosticError, DiagnosticSink, Loc, closest, did_you_mean, plural
from .module import Module
from .plan import Layout, Plan
from .verify_emus import verify_emus
from .verify_transition import verify_transitions


def verify(m: Module) -> Module:
    """Check every semantic rule; returns ``m`` or raises DiagnosticError with all errors."""
    sink = DiagnosticSink(m.filename)
    _clusters(m, sink)
    _models(m, sink)
    broken = _workloads(m, sink)
    for plan in m.plans.values():
        _plan(m, plan, sink, broken)
    verify_emus(m, sink)
    verify_transitions(m, sink)
    sink.raise_if_any(m.source)
    return m


def require_declarations(m: Module) -> Module:
    """Raise a diagnostic when ``m`` declares nothing: for a command given a file, an empty one (or
    one of comments only) is most likely the wrong file or an unsaved buffer, not a job. ``verify``
    itself accepts the empty module, which is valid IR (and what a pass may start from)."""
    if any((m.clusters, m.models, m.workloads, m.plans, m.emus, m.transitions)):
        return m
    what = "the file holds only comments" if m.trailing_comments else "the file is empty"
    raise DiagnosticError(
        [
            Diagnostic(
                Loc(0, 0, m.filename),
                f"empty module: {what}, nothing to check",
                "a .nir file declares a cluster, models, a workload and plans (README.md's tour of the IR, docs/IR.md)",
            )
        ]
    )


def at(node, key: str) -> Loc:
    """Location of attribute ``key`` of ``node``, or of the node itself."""
    return node.locs.get(key, node.loc)


def resolve(m: Module, kind: str, name: str, loc: Loc, sink: DiagnosticSink, who: str):
    """Look up ``@name`` among declarations of ``kind``; report a missing or wrong-kind one."""
    table = getattr(m, kind + "s")
    if name in table:
        return table[name]
    for other in ("cluster", "model", "workload", "plan", "transition"):
        if name in getattr(m, other + "s"):
            sink.error(loc, f"{who} refers to @{name}, which is a {other}, not a {kind}")
            return None
    sink.error(
        loc,
        f"{who} refers to unknown {kind} @{name}",
        did_you_mean(name, table)
        or (f"declared {kind}s: " + ", ".join("@" + n for n in table) if table else f"no {kind} is declared"),
    )
    return None


def _gpus(gpus) -> str:
    """``GPU 8`` or ``GPUs 16..31, 40``: the GPUs a diagnostic names, at most about 60 characters of them."""
    gpus = sorted(gpus)
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    text = compress_ints(gpus)
    if len(text) > 60:
        cut = text.rfind(",", 0, 60)
        text = text[: cut if cut > 0 else 60] + f", ... ({len(gpus)} GPUs)"
    return f"GPUs {text}"


def _has_gpus(c) -> str:
    return (
        f"cluster @{c.name} has GPUs 0..{c.num_gpus - 1} ({c.nodes} node{'s' if c.nodes != 1 else ''} x "
        f"{c.gpus_per_node})"
    )


def _clusters(m: Module, sink: DiagnosticSink) -> None:
    for c in m.clusters.values():
        seen, twice = set(), set()
        for g in c.unavailable:
            if g in seen:
                twice.add(g)
            seen.add(g)
        missing = sorted(g for g in seen if g >= c.num_gpus)
        if missing:
            sink.error(
                at(c, "unavailable"),
                f"unavailable {_gpus(missing)} {'does' if len(missing) == 1 else 'do'} not exist: {_has_gpus(c)}",
            )
        if twice:
            sink.error(
                at(c, "unavailable"), f"{_gpus(twice)} {'is' if len(twice) == 1 else 'are'} listed twice in unavailable"
            )
        for key in ("gpu_memory", "peak_flops", "hbm_bandwidth"):
            if getattr(c, key) <= 0:
                sink.error(at(c, key), f"{key} must be positive")
        for key in ("intra_node", "inter_node", "host_link"):
            link = getattr(c, key)
            if link is not None and link.bandwidth <= 0:
                sink.error(at(c, key), f"{key} bandwidth must be positive")


def _models(m: Module, sink: DiagnosticSink) -> None:
    for md in m.models.values():
        if md.head_dim is None and md.hidden % md.heads:
            sink.error(
                at(md, "heads"),
                f"hidden = {md.hidden} is not divisible by heads = {md.heads}",
                "set head_dim explicitly when the head dimension is not hidden / heads",
            )
        if md.heads % md.kv_heads:
            sink.error(
                at(md, "kv_heads"),
                f"heads = {md.heads} is not a multiple of kv_heads = {md.kv_heads}",
                "grouped-query attention shares each K/V head among heads / kv_heads query heads",
            )
        if md.head == "value" and md.tied_embeddings:
            sink.error(at(md, "tied_embeddings"), f"model @{md.name} has a value head, so there is no LM head to tie")
        _experts(md, sink)


MOE_ATTRS = ("experts_per_token", "expert_ffn", "shared_expert_ffn", "dense_layers")


def _experts(md, sink: DiagnosticSink) -> None:
    """A mixture of experts: its attributes together and consistent."""
    if md.experts is None:
        for key in MOE_ATTRS:
            if getattr(md, key) is not None:
                sink.error(
                    at(md, key), f"{key} = {getattr(md, key)} but model @{md.name} has no experts", "set experts"
                )
        if md.moe_naming != "qwen":
            sink.error(at(md, "moe_naming"), f"moe_naming = {md.moe_naming} but model @{md.name} has no experts")
        return
    for key in ("experts_per_token", "expert_ffn"):
        if getattr(md, key) is None:
            sink.error(at(md, "experts"), f"model @{md.name} has experts = {md.experts} but no {key}")
    if md.experts < 2:
        sink.error(at(md, "experts"), f"experts = {md.experts}: a mixture needs at least 2 experts")
    if md.experts_per_token is not None and md.experts_per_token > md.experts:
        sink.error(
            at(md, "experts_per_token"),
            f"experts_per_token = {md.experts_per_token} is more than experts = {md.experts}",
            "each token is routed to experts_per_token of the experts",
        )
    if md.mlp != "gated":
        sink.error(at(md, "mlp"), f"mlp = {md.mlp}: the experts are SwiGLU MLPs (mlp = gated)")
    if md.moe_naming == "mixtral" and md.shared_expert_ffn is not None:
        sink.error(at(md, "shared_expert_ffn"), "moe_naming = mixtral: Mixtral has no shared expert")
    if md.dense_layers is not None and md.dense_layers >= md.layers:
        sink.error(
            at(md, "dense_layers"),
            f"dense_layers = {md.dense_layers}: model @{md.name} has {md.layers} layers, so none would be MoE",
            "drop experts for a dense model, or keep fewer dense layers",
        )


def _workloads(m: Module, sink: DiagnosticSink) -> set[str]:
    """Check workloads; returns the names of those whose stages are unusable for plan checks."""
    broken: set[str] = set()
    for w in m.workloads.values():
        roles = set()
        for r in w.roles:
            if r in roles:
                sink.error(at(w, "roles"), f"role @{r} is listed twice")
            roles.add(r)
            resolve(m, "model", r, at(w, "roles"), sink, f"workload @{w.name}")
        if w.prompt_len_mean > w.prompt_len_max:
            sink.error(
                at(w, "prompt_len_mean"),
                f"prompt_len_mean = {w.prompt_len_mean} exceeds prompt_len_max = {w.prompt_len_max}",
            )
        if w.response_len_mean > w.response_len_max:
            sink.error(
                at(w, "response_len_mean"),
                f"response_len_mean = {w.response_len_mean} exceeds response_len_max = {w.response_len_max}",
            )
        if w.response_len_dist:
            d = w.response_len_dist
            mean = sum(d) / len(d)
            if any(b < a for a, b in zip(d, d[1:])) or d[0] < 1:
                sink.error(
                    at(w, "response_len_dist"),
                    "response_len_dist is not a distribution: its lengths must be "
                    "positive and in order, shortest first",
                    "list the lengths of equal shares of the responses, e.g. [256, 512, 1024, 4096]",
                )
            elif d[-1] > w.response_len_max:
                sink.error(
                    at(w, "response_len_dist"),
                    f"response_len_dist reaches {d[-1]}, beyond response_len_max = {w.response_len_max}",
                )
            elif abs(mean - w.response_len_mean) > 0.5:
                sink.error(
                    at(w, "response_len_dist"),
                    f"response_len_dist has mean {mean:g}, but response_len_mean = {w.response_len_mean}",
                    f"set response_len_mean = {round(mean)}",
                )
        if w.algorithm == "grpo" and w.group_size < 2:
            sink.error(
                at(w, "group_size"), "GRPO compares a group of responses per prompt: group_size must be at least 2"
            )
        _batch_sizes(w, sink)
        if not w.stages:
            broken.add(w.name)
            sink.error(
                w.loc, f"workload @{w.name} has no stages", "add: stage generate { kind = generate, models = [@actor] }"
            )
        has_critic = False
        for st in w.stages:
            for r in st.models:
                if r not in roles:
                    broken.add(w.name)
                    if r in m.models and any(closest(x, m.models) == r for x in roles if x not in m.models):
                        continue  # roles misspell @r (`[@reff]`): reported there, with the hint 'ref'
                    sink.error(
                        at(st, "models"),
                        f"stage {st.name} runs @{r}, which is not a role of workload @{w.name}",
                        f"add it to the roles: roles = [{', '.join('@' + x for x in [*w.roles, r])}]"
                        if r in m.models
                        else did_you_mean(r, roles),
                    )
                    continue
                md = m.models.get(r)
                if md is None:
                    broken.add(w.name)
                    continue
                if st.kind == "train" and not md.trained:
                    sink.error(
                        at(st, "models"),
                        f"model @{r} is frozen (trained = false) but stage {st.name} trains it",
                        f"set trained = true in model @{r}, or move it to an infer stage",
                    )
                if st.kind == "generate" and md.head != "lm":
                    sink.error(at(st, "models"), f"model @{r} has a value head and cannot generate")
                if st.kind == "train" and md.head == "value":
                    has_critic = True
            if len(set(st.models)) != len(st.models):
                sink.error(at(st, "models"), f"stage {st.name} lists a model twice")
        if w.algorithm == "ppo" and w.stages and not has_critic:
            sink.error(
                w.loc,
                f"PPO workload @{w.name} trains no critic (a model with head = value)",
                "GRPO needs no critic: algorithm = grpo",
            )
    return broken


def _plan(m: Module, plan: Plan, sink: DiagnosticSink, broken: set[str]) -> None:
    w = resolve(m, "workload", plan.workload, at(plan, "workload"), sink, f"plan @{plan.name}")
    c = resolve(m, "cluster", plan.cluster, at(plan, "cluster"), sink, f"plan @{plan.name}")
    if w is None or w.name in broken:
        return  # the workload's own errors are reported; matching layouts to it would cascade
    expected = w.model_stages()
    for ms, lay in plan.layouts.items():
        if ms not in expected:
            sink.error(
                lay.loc,
                f"layout {ms}: workload @{w.name} has no model-stage {ms}",
                did_you_mean(ms, expected) or "model-stages: " + ", ".join(expected),
            )
    missing = [ms for ms in expected if ms not in plan.layouts]
    if missing:
        sink.error(
            plan.loc,
            f"plan @{plan.name} has no layout for {', '.join(missing)}",
            "every model-stage of the workload needs a layout",
        )
    for ms, lay in plan.layouts.items():
        model = m.models.get(lay.model)
        stage = w.stage_of(ms)
        if model is not None and ms in expected:
            _verify_layout(lay, model, stage, c, sink)
            _verify_micro_batches(lay, w, stage, sink)
            _verify_context_parallel(lay, w, stage, sink)
    _colocation(plan, w, sink)


def _verify_layout(lay: Layout, model, stage, cluster, sink: DiagnosticSink) -> None:
    ms = lay.model_stage
    if model.heads % lay.tp:
        # a TP degree must split the query heads and the K/V heads, and fit in the cluster
        # (28 heads allow TP 28, which no 16-GPU cluster runs)
        gpus = len(cluster.available_gpus()) if cluster is not None else model.heads
        ok = [
            t
            for t in range(1, min(model.heads, gpus) + 1)
            if model.heads % t == 0 and (t % model.kv_heads == 0 or model.kv_heads % t == 0)
        ]
        sink.error(
            at(lay, "tp"),
            f"{ms}: tp = {lay.tp} does not divide heads = {model.heads} of model @{model.name}",
            "choose tp from "
            + ", ".join(map(str, ok[:12]))
            + (
                f" (at most the {plural(gpus, 'GPU')} of cluster @{cluster.name})"
                if cluster is not None and gpus < model.heads
                else ""
            ),
        )
    elif lay.tp > model.kv_heads and lay.tp % model.kv_heads:
        sink.error(
            at(lay, "tp"),
            f"{ms}: tp = {lay.tp} is above kv_heads = {model.kv_heads} but not a multiple of it",
            "K/V heads are replicated on tp / kv_heads ranks, which must be a whole number",
        )
    elif lay.tp <= model.kv_heads and model.kv_heads % lay.tp:
        sink.error(at(lay, "tp"), f"{ms}: tp = {lay.tp} does not divide kv_heads = {model.kv_heads}")
    # pipeline layer ranges: one per stage, contiguous, covering every layer in order
    if len(lay.layers) != lay.pp:
        sink.error(
            at(lay, "layers"),
            f"{ms}: pp = {lay.pp} but layers lists {plural(len(lay.layers), 'range')}",
            "give one inclusive layer range per pipeline stage, e.g. [0..15, 16..31]",
        )
    else:
        nxt = 0
        for lo, hi in lay.layers:
            if lo != nxt or hi < lo:
                sink.error(
                    at(lay, "layers"),
                    f"{ms}: pipeline stage layers {lo}..{hi} should start at layer {nxt}",
                    "stage ranges must be non-empty, in order, with no gap or overlap",
                )
                break
            nxt = hi + 1
        else:
            if nxt != model.layers:
                sink.error(
                    at(lay, "layers"),
                    f"{ms}: layers cover 0..{nxt - 1} but model @{model.name} has {plural(model.layers, 'layer')} "
                    f"(0..{model.layers - 1})",
                )
    if len(lay.mesh) != lay.world:
        sink.error(
            at(lay, "mesh"),
            f"{ms}: mesh has {plural(len(lay.mesh), 'GPU')} but "
            + (f"dp x cp x pp x tp = {lay.dp} x {lay.cp} x" if lay.cp > 1 else f"dp x pp x tp = {lay.dp} x")
            + f" {lay.pp} x {lay.tp} = {lay.world}",
        )
    # one diagnostic per kind of mistake, naming every GPU it concerns (a 4-node mesh on 2 nodes
    # is one error with the range, not one per GPU)
    seen: set[int] = set()
    twice: set[int] = set()
    for g in lay.mesh:
        if g in seen:
            twice.add(g)
        seen.add(g)
    if twice:
        sink.error(
            at(lay, "mesh"), f"{ms}: {_gpus(twice)} {'appears' if len(twice) == 1 else 'appear'} twice in the mesh"
        )
    if cluster is not None:
        missing = sorted(g for g in seen if g >= cluster.num_gpus)
        if missing:
            sink.error(
                at(lay, "mesh"),
                f"{ms}: {_gpus(missing)} {'does not exist' if len(missing) == 1 else 'of the mesh do not exist'}"
                f": {_has_gpus(cluster)}",
                f"the mesh reaches node {max(missing) // cluster.gpus_per_node}: give cluster @{cluster.name} nodes = "
                f"{max(missing) // cluster.gpus_per_node + 1}"
                + (
                    f", or place the layout on GPUs 0..{cluster.num_gpus - 1}"
                    if len(lay.mesh) <= cluster.num_gpus
                    else ""
                ),
            )
        down = sorted(seen & set(cluster.unavailable))
        if down:
            sink.error(
                at(lay, "mesh"),
                f"{ms}: {_gpus(down)} {'is' if len(down) == 1 else 'are'} unavailable in cluster @{cluster.name}",
            )
    if not 0 <= lay.zero <= 3:
        sink.error(at(lay, "zero"), f"{ms}: zero = {lay.zero}; ZeRO stages are 0, 1, 2 and 3")
    train = stage is not None and stage.kind == "train"
    if lay.zero and not train:
        sink.error(at(lay, "zero"), f"{ms}: ZeRO shards training state, but {ms} does not train")
    if lay.recompute and not train:
        sink.error(at(lay, "recompute"), f"{ms}: activation recomputation applies only to training")
    if lay.sp and lay.tp == 1:
        sink.error(
            at(lay, "sp"), f"{ms}: sequence parallelism shards activations over TP, but tp = 1", "set tp > 1 or drop sp"
        )
    if lay.tp_overlap and not lay.sp:
        sink.error(
            at(lay, "tp_overlap"),
            f"{ms}: TP communication overlaps the GEMMs only under sequence parallelism (Megatron-LM's rule)",
            "set sp = true",
        )
    elif lay.tp_overlap and stage is not None and stage.kind == "generate":
        sink.error(at(lay, "tp_overlap"), f"{ms}: tp_overlap is a training and inference setting, not generation's")
    if lay.pp_overlap is not None and stage is not None and stage.kind == "generate":
        sink.error(
            at(lay, "pp_overlap"),
            f"{ms}: pp_overlap is a training and inference setting; a generation engine's pipeline is its own",
        )
    elif lay.pp_overlap and lay.pipeline_schedule == "one_f_one_b":
        sink.error(
            at(lay, "pp_overlap"),
            f"{ms}: 1F1B's steady state leaves a posted send no slack (each waits on its neighbour's "
            "reply); Megatron posts pipeline sends only in the interleaved schedule",
            "set vpp > 1 (interleaved) or drop pp_overlap",
        )
    elif lay.pp_overlap is False and lay.pipeline_schedule in ("gpipe", "zero_bubble", "zbv"):
        sink.error(
            at(lay, "pp_overlap"),
            f"{ms}: torch's {lay.pipeline_schedule} schedule posts its pipeline sends and waits for them at the "
            "step's end",
            "drop pp_overlap",
        )
    if not lay.dp_overlap and stage is not None and stage.kind != "train":
        sink.error(at(lay, "dp_overlap"), f"{ms}: dp_overlap is a training setting: {stage.kind} reduces no gradients")
    if lay.fp8 and cluster is not None and not cluster.peak_flops_fp8:
        sink.error(
            at(lay, "fp8"),
            f"{ms}: fp8 GEMMs need the FP8 peak of cluster @{cluster.name}",
            "give the cluster peak_flops_fp8, e.g. 1979TFLOPs for an H100",
        )
    if lay.attention != "flash" and stage is not None and stage.kind == "generate":
        sink.error(
            at(lay, "attention"),
            f"{ms}: attention = {lay.attention} is a training and inference setting; a generation engine "
            "runs its own paged attention kernels",
        )
    elif lay.attention == "recomputed" and (lay.recompute or not train):
        sink.error(
            at(lay, "attention"),
            f"{ms}: attention = recomputed is selective recomputation, which "
            + ("full recomputation (recompute) already covers" if lay.recompute else "only training runs"),
            "use attention = materialized",
        )
    if lay.grad_dtype != "bf16" and not train:
        sink.error(at(lay, "grad_dtype"), f"{ms}: only a training model-stage keeps gradients")
    if lay.vpp > 1:
        if stage is not None and stage.kind == "generate":
            sink.error(
                at(lay, "vpp"), f"{ms}: virtual pipeline stages are a training and inference schedule, not generation's"
            )
        elif lay.pp < 2:
            sink.error(at(lay, "vpp"), f"{ms}: vpp = {lay.vpp} interleaves pipeline stages, but pp = {lay.pp}")
        elif len(lay.layers) == lay.pp and any((hi - lo + 1) % lay.vpp for lo, hi in lay.layers):
            sizes = ", ".join(str(hi - lo + 1) for lo, hi in lay.layers)
            sink.error(
                at(lay, "vpp"),
                f"{ms}: vpp = {lay.vpp} virtual stages do not divide the layers of every pipeline stage ({sizes})",
                "choose vpp dividing every stage's layer count",
            )
        elif lay.pipeline_schedule == "interleaved" and lay.micro_batches % lay.pp:
            sink.error(
                at(lay, "vpp"),
                f"{ms}: the interleaved schedule needs micro_batches = {lay.micro_batches} to be a "
                f"multiple of pp = {lay.pp}",
                f"use micro_batches = {lay.micro_batches // lay.pp * lay.pp or lay.pp}",
            )
    if lay.schedule is not None:
        _verify_schedule(lay, stage, sink)
    _verify_experts(lay, model, sink)
    for what in lay.offload:
        if what in ("grads", "optimizer") and not train:
            sink.error(at(lay, "offload"), f"{ms}: only a training model-stage has {what} to offload")
    if lay.offload and cluster is not None and (cluster.host_link is None or cluster.host_memory is None):
        absent = " and ".join(k for k in ("host_link", "host_memory") if getattr(cluster, k) is None)
        sink.error(
            at(lay, "offload"),
            f"{ms}: offload moves state to host memory, but cluster @{cluster.name} declares no {absent}",
            "give the cluster host_link = link(bandwidth = 55GB/s, latency = 10us) and host_memory = 2TiB "
            "(an H100 node's PCIe 5 and DRAM), or drop offload",
        )


def _verify_schedule(lay: Layout, stage, sink: DiagnosticSink) -> None:
    """A named pipeline schedule (``schedule``): a training pipeline's, with the chunks and
    micro-batches it runs (torch.distributed.pipelining's rules for its zero-bubble schedules)."""
    ms, sched, p, v, m = lay.model_stage, lay.schedule, lay.pp, lay.vpp, lay.micro_batches
    if stage is not None and stage.kind != "train":
        sink.error(
            at(lay, "schedule"), f"{ms}: a pipeline schedule orders backward passes; a {stage.kind} stage has none"
        )
    elif p < 2:
        sink.error(at(lay, "schedule"), f"{ms}: schedule = {sched} orders pipeline stages, but pp = {p}")
    elif sched in ("one_f_one_b", "gpipe") and v != 1:
        sink.error(
            at(lay, "schedule"),
            f"{ms}: schedule = {sched} runs one stage per rank, but vpp = {v}",
            "use schedule = interleaved or zero_bubble, or drop vpp",
        )
    elif sched == "interleaved" and v < 2:
        sink.error(at(lay, "schedule"), f"{ms}: the interleaved schedule needs vpp > 1", "set vpp = 2")
    elif sched == "zbv" and v != 2:
        sink.error(
            at(lay, "schedule"), f"{ms}: zbv runs exactly two stages per rank (a V), but vpp = {v}", "set vpp = 2"
        )
    elif sched == "zero_bubble" and m % max(1, m // p):
        rounds = max(1, m // p)
        sink.error(
            at(lay, "schedule"),
            f"{ms}: zero_bubble runs micro_batches in {rounds} rounds of pp = {p}; {m} is not a multiple of {rounds}",
            f"use micro_batches = {rounds * p}",
        )


def _verify_experts(lay: Layout, model, sink: DiagnosticSink) -> None:
    """Expert parallelism: a mixture of experts, EP dividing its experts, ETP dividing TP, and EP x
    ETP ranks carved from a pipeline stage's dp x cp x tp."""
    ms = lay.model_stage
    if lay.ep == 1 and lay.etp is None:
        return
    key = "ep" if lay.ep > 1 else "etp"
    if model is None:
        return
    if not model.moe:
        sink.error(
            at(lay, key),
            f"{ms}: {key} = {getattr(lay, key)} splits experts, but model @{model.name} has none",
            "drop ep and etp, or give the model experts, experts_per_token and expert_ffn",
        )
        return
    if lay.etp is not None and lay.tp % lay.etp:
        sink.error(
            at(lay, "etp"),
            f"{ms}: etp = {lay.etp} does not divide tp = {lay.tp}",
            "expert TP ranks are carved from the TP group: choose etp dividing tp",
        )
        return
    if model.experts % lay.ep:
        sink.error(
            at(lay, "ep"),
            f"{ms}: ep = {lay.ep} does not divide experts = {model.experts} of model @{model.name}",
            _use("ep", [d for d in range(1, model.experts + 1) if model.experts % d == 0 and d <= lay.ep * 2]),
        )
        return
    ranks = lay.replicas * lay.tp
    carved = lay.ep * lay.expert_tp
    if carved > ranks or ranks % carved:
        sink.error(
            at(lay, "ep"),
            f"{ms}: ep x etp = {lay.ep} x {lay.expert_tp} = {carved} expert ranks "
            + ("are more than" if carved > ranks else "do not divide")
            + f" the {ranks} ranks of a pipeline stage (dp x cp x tp = {lay.dp} x {lay.cp} x {lay.tp})"
            " they are carved from",
            "Megatron carves EP x ETP from dp x cp x tp: choose ep x etp dividing it",
        )


def flush_samples(w, kind: str) -> int:
    """Samples one pipeline flush takes, over all DP replicas: a mini-batch when training (an
    optimizer step ends the flush), every sample of the step when only running forward."""
    return (w.mini_batch or w.samples) if kind == "train" else w.samples


def _divisors_near(n: int, x: int, step: int = 1) -> list[int]:
    """The multiples of ``step`` that divide ``n`` nearest ``x``, one below and one above (``x``
    excluded): the fixes a batch-size diagnostic suggests. None past 10**10 (a typo, not a batch)."""
    if n % step or n > 10**10:
        return []
    divs: set[int]
    m, divs = n // step, set()
    i = 1
    while i * i <= m:
        if m % i == 0:
            divs.update((i * step, m // i * step))
        i += 1
    below, above = [v for v in divs if v < x], [v for v in divs if v > x]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _use(key: str, values: list[int]) -> str | None:
    return f"use {key} = " + " or ".join(map(str, values)) if values else None


def _join(*parts: str | None) -> str | None:
    """``use dp = 1 or 5`` and ``use micro_batch = 10`` -> ``use dp = 1 or 5, or micro_batch = 10``."""
    given = [p for p in parts if p]
    return ", or ".join([given[0], *(p.removeprefix("use ") for p in given[1:])]) if given else None


def replicas_share_steps(w, kind: str, dp: int) -> bool:
    """Whether ``dp`` data-parallel replicas of a ``kind`` model-stage take a whole number of
    micro-batches each per optimizer step: for training, micro_batch x dp divides mini_batch (or
    the step's samples without one), as Megatron-LM (global batch % (micro batch x DP) == 0) and
    verl (ppo_mini_batch_size / DP % ppo_micro_batch_size_per_gpu == 0) require. Forward-only
    stages and workloads whose own sizes do not nest (an error at the workload) pass."""
    if kind != "train" or not batches_split(w):
        return True
    return (w.mini_batch or w.samples) % (w.micro_batch * dp) == 0


def batches_split(w) -> bool:
    """Whether the workload's batch sizes nest: micro_batch divides mini_batch, which divides the
    samples of a step (without mini_batch, one optimizer step takes them all)."""
    mini = w.mini_batch or w.samples
    return mini <= w.samples and w.samples % mini == 0 and w.micro_batch <= mini and mini % w.micro_batch == 0


def _batch_sizes(w, sink: DiagnosticSink) -> None:
    """A step's samples (global_batch x group_size) split into optimizer steps of mini_batch
    samples, each into micro-batches of micro_batch samples per replica: each size divides the one
    above, as Megatron-LM and verl require (neither runs a ragged mini- or micro-batch)."""
    n, mini, mb = w.samples, w.mini_batch, w.micro_batch
    per_step = "samples per step = global_batch x group_size = " + (
        f"{w.global_batch} x {w.group_size}" if w.group_size > 1 else f"{n} x 1"
    )
    if mini is not None and (mini > n or n % mini):
        fix = _use("mini_batch", _divisors_near(n, mini, mb))
        if fix is None and (fix := _use("mini_batch", _divisors_near(n, mini))):
            fix += " with a micro_batch dividing it"
        sink.error(
            at(w, "mini_batch"),
            f"mini_batch = {mini} "
            + (f"exceeds the {n} samples of a step" if mini > n else f"does not divide the {n} samples of a step"),
            "; ".join(p for p in (per_step, fix) if p),
        )
        return
    if mb > n:
        sink.error(
            at(w, "micro_batch"),
            f"micro_batch = {mb} exceeds the {n} samples of a step",
            f"{per_step}; use micro_batch <= {n}",
        )
        return
    if mini is not None and mb > mini:
        sink.error(
            at(w, "micro_batch"),
            f"micro_batch = {mb} exceeds mini_batch = {mini}: a replica's forward and backward "
            "pass would take more samples than an optimizer step",
            _use("micro_batch", _divisors_near(mini, mb)),
        )
        return
    flush = mini or n
    if flush % mb:
        if mini is None:
            sink.error(
                at(w, "micro_batch"),
                f"micro_batch = {mb} does not divide the {n} samples of a step (one optimizer "
                "step: mini_batch is not set)",
                _use("micro_batch", _divisors_near(n, mb)),
            )
            return
        sink.error(
            at(w, "mini_batch"),
            f"mini_batch = {mini} is not a multiple of micro_batch = {mb}: an optimizer step "
            "would end inside a micro-batch",
            _join(_use("micro_batch", _divisors_near(mini, mb)), _use("mini_batch", _divisors_near(n, mini, mb))),
        )


def batch_warnings(m: Module) -> list[Diagnostic]:
    """Training layouts whose data-parallel replicas cannot share an optimizer step's micro-batches
    evenly: micro_batch x dp does not divide mini_batch. Megatron-LM requires global batch % (micro
    batch x DP) == 0 and verl ppo_mini_batch_size / DP % ppo_micro_batch_size_per_gpu == 0, so such a
    plan does not run there as written. (Context-parallel ranks share their replica's micro-batch.)

    Warnings, which ``nereus check`` prints, not errors of ``verify``: the cost model counts a
    replica's share of a step as samples / dp, fractions included, and a framework that pads its
    batches runs such a plan (plan-search and the greedy baseline propose only DP degrees that
    split evenly, ``replicas_share_steps``). Call it on a verified module."""
    out = []
    for plan in m.plans.values():
        w = m.workloads.get(plan.workload)
        if w is None or not batches_split(w):
            continue  # the workload's own batch sizes are errors at the workload
        flush, mb = w.mini_batch or w.samples, w.micro_batch
        for ms, lay in plan.layouts.items():
            stage = w.stage_of(ms)
            if stage is None or replicas_share_steps(w, stage.kind, lay.dp):
                continue
            what = (
                f"mini_batch = {flush}"
                if w.mini_batch
                else f"the {flush} samples of a step (one optimizer step: mini_batch is not set)"
            )
            micro = _divisors_near(flush // lay.dp, mb) if flush % lay.dp == 0 else []
            fixes = _join(_use("dp", _divisors_near(flush // mb, lay.dp)), _use("micro_batch", micro))
            out.append(
                Diagnostic(
                    at(lay, "dp"),
                    f"{ms}: micro_batch x dp = {mb} x {lay.dp} = {mb * lay.dp} does not divide {what}: "
                    "Megatron-LM and verl reject this split",
                    f"an optimizer step is {plural(flush // mb, 'micro-batch', 'micro-batches')}, "
                    f"which {plural(lay.dp, 'replica')} "
                    "cannot share evenly" + (f": {fixes}" if fixes else ""),
                    severity="warning",
                )
            )
    return out


def _verify_micro_batches(lay: Layout, w, stage, sink: DiagnosticSink) -> None:
    """A pipeline cannot split a flush into more micro-batches than the flush has."""
    if stage is None or stage.kind == "generate" or lay.pp == 1:
        return
    flush = flush_samples(w, stage.kind)
    need = lay.micro_batches * w.micro_batch * lay.dp
    if need > flush:
        most = flush // (w.micro_batch * lay.dp)
        what = (
            "one mini-batch (mini_batch" + ("" if w.mini_batch else ", default: the step's samples") + ")"
            if stage.kind == "train"
            else "the step (global_batch x group_size)"
        )
        sink.error(
            at(lay, "micro_batches"),
            f"{lay.model_stage}: micro_batches = {lay.micro_batches} x micro_batch = {w.micro_batch} x dp = "
            f"{lay.dp} is {need} samples per pipeline flush, but {what} holds {flush}",
            f"use micro_batches <= {most}"
            if most >= 1
            else f"dp = {lay.dp} replicas of micro_batch = {w.micro_batch} need more than {flush} samples: lower dp",
        )


def _verify_context_parallel(lay: Layout, w, stage, sink: DiagnosticSink) -> None:
    """CP splits a training or inference pass's sequence into ``2 cp`` load-balanced causal
    chunks (two per rank, Megatron-LM's rule), so ``2 cp`` must divide the padded sequence."""
    if lay.cp == 1 or stage is None:
        return
    if stage.kind == "generate":
        sink.error(
            at(lay, "cp"),
            f"{lay.model_stage}: context parallelism splits a training or inference pass's sequence, not generation's",
            "drop cp on the generate stage",
        )
        return
    seq = w.prompt_len_max + w.response_len_max
    if seq % (2 * lay.cp):
        ok = [c for c in range(2, 17) if seq % (2 * c) == 0]
        sink.error(
            at(lay, "cp"),
            f"{lay.model_stage}: cp = {lay.cp} splits each sequence into {2 * lay.cp} causal chunks, "
            f"which do not divide the sequence prompt_len_max + response_len_max = {seq}",
            ("choose cp from " + ", ".join(map(str, ok))) if ok else "pad the sequence to a multiple of 2 x cp",
        )


def _colocation(plan: Plan, w, sink: DiagnosticSink) -> None:
    grouped: dict[str, int] = {}
    for i, group in enumerate(plan.colocate):
        stages = set()
        for ms in group:
            if ms not in plan.layouts:
                sink.error(at(plan, "colocate"), f"colocate names {ms}, which has no layout in plan @{plan.name}")
                continue
            if ms in grouped:
                sink.error(at(plan, "colocate"), f"{ms} is in two colocate groups")
            grouped[ms] = i
            stages.add(plan.layouts[ms].stage)
        if len(stages) > 1:
            sink.error(
                at(plan, "colocate"),
                "a colocate group joins model-stages of one stage: got stages " + ", ".join(sorted(stages)),
                "model-stages of different stages run at different times and share GPUs without being colocated",
            )
    for st in w.stages:
        seen: dict[int, str] = {}
        for ms in st.model_stages():
            lay = plan.layouts.get(ms)
            if lay is None:
                continue
            for g in lay.mesh:
                other = seen.get(g)
                if other is not None and other != ms and not plan.shares(other, ms):
                    sink.error(
                        at(lay, "mesh"),
                        f"GPU {g} is used by both {other} and {ms} in stage {st.name}",
                        f"add colocate = [[{other}, {ms}]] to run them one after another on shared GPUs",
                    )
                    break
                seen.setdefault(g, ms)
