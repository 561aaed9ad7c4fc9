"""Semantic rules of the IR: every rule a user can break, reported at the offending line.

``verify`` collects every error and raises one ``DiagnosticError``. Rules that need a
referenced declaration are skipped when that declaration is missing (the missing reference
is the error), so one typo does not produce a cascade.
"""

from __future__ import annotations

from .diagnostics import DiagnosticSink, Loc, did_you_mean
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
    sink.error(loc, f"{who} refers to unknown {kind} @{name}", did_you_mean(name, table) or
               (f"declared {kind}s: " + ", ".join("@" + n for n in table) if table else f"no {kind} is declared"))
    return None


def _clusters(m: Module, sink: DiagnosticSink) -> None:
    for c in m.clusters.values():
        seen = set()
        for g in c.unavailable:
            if g >= c.num_gpus:
                sink.error(at(c, "unavailable"), f"unavailable GPU {g} does not exist: cluster @{c.name} has GPUs 0..{c.num_gpus - 1}")
            if g in seen:
                sink.error(at(c, "unavailable"), f"GPU {g} is listed twice in unavailable")
            seen.add(g)
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
            sink.error(at(md, "heads"), f"hidden = {md.hidden} is not divisible by heads = {md.heads}",
                       "set head_dim explicitly when the head dimension is not hidden / heads")
        if md.heads % md.kv_heads:
            sink.error(at(md, "kv_heads"), f"heads = {md.heads} is not a multiple of kv_heads = {md.kv_heads}",
                       "grouped-query attention shares each K/V head among heads / kv_heads query heads")
        if md.head == "value" and md.tied_embeddings:
            sink.error(at(md, "tied_embeddings"), f"model @{md.name} has a value head, so there is no LM head to tie")


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
            sink.error(at(w, "prompt_len_mean"), f"prompt_len_mean = {w.prompt_len_mean} exceeds prompt_len_max = {w.prompt_len_max}")
        if w.response_len_mean > w.response_len_max:
            sink.error(at(w, "response_len_mean"), f"response_len_mean = {w.response_len_mean} exceeds response_len_max = {w.response_len_max}")
        if w.response_len_dist:
            d = w.response_len_dist
            mean = sum(d) / len(d)
            if any(b < a for a, b in zip(d, d[1:])) or d[0] < 1:
                sink.error(at(w, "response_len_dist"), "response_len_dist is not a distribution: its lengths must be "
                                                       "positive and in order, shortest first", "list the lengths of equal "
                                                                                                "shares of the responses, e.g. [256, 512, 1024, 4096]")
            elif d[-1] > w.response_len_max:
                sink.error(at(w, "response_len_dist"), f"response_len_dist reaches {d[-1]}, beyond response_len_max = {w.response_len_max}")
            elif abs(mean - w.response_len_mean) > 0.5:
                sink.error(at(w, "response_len_dist"), f"response_len_dist has mean {mean:g}, but response_len_mean = {w.response_len_mean}",
                           f"set response_len_mean = {round(mean)}")
        if w.algorithm == "grpo" and w.group_size < 2:
            sink.error(at(w, "group_size"), "GRPO compares a group of responses per prompt: group_size must be at least 2")
        if w.mini_batch is not None and (w.mini_batch > w.samples or w.samples % w.mini_batch):
            sink.error(at(w, "mini_batch"), f"mini_batch = {w.mini_batch} does not divide the {w.samples} samples of a step",
                       "samples per step = global_batch x group_size")
        if w.micro_batch > w.samples:
            sink.error(at(w, "micro_batch"), f"micro_batch = {w.micro_batch} exceeds the {w.samples} samples of a step")
        if not w.stages:
            broken.add(w.name)
            sink.error(w.loc, f"workload @{w.name} has no stages", "add: stage generate { kind = generate, models = [@actor] }")
        has_critic = False
        for st in w.stages:
            for r in st.models:
                if r not in roles:
                    broken.add(w.name)
                    sink.error(at(st, "models"), f"stage {st.name} runs @{r}, which is not a role of workload @{w.name}",
                               did_you_mean(r, roles))
                    continue
                md = m.models.get(r)
                if md is None:
                    broken.add(w.name)
                    continue
                if st.kind == "train" and not md.trained:
                    sink.error(at(st, "models"), f"model @{r} is frozen (trained = false) but stage {st.name} trains it",
                               f"set trained = true in model @{r}, or move it to an infer stage")
                if st.kind == "generate" and md.head != "lm":
                    sink.error(at(st, "models"), f"model @{r} has a value head and cannot generate")
                if st.kind == "train" and md.head == "value":
                    has_critic = True
            if len(set(st.models)) != len(st.models):
                sink.error(at(st, "models"), f"stage {st.name} lists a model twice")
        if w.algorithm == "ppo" and w.stages and not has_critic:
            sink.error(w.loc, f"PPO workload @{w.name} trains no critic (a model with head = value)",
                       "GRPO needs no critic: algorithm = grpo")
    return broken


def _plan(m: Module, plan: Plan, sink: DiagnosticSink, broken: set[str]) -> None:
    w = resolve(m, "workload", plan.workload, at(plan, "workload"), sink, f"plan @{plan.name}")
    c = resolve(m, "cluster", plan.cluster, at(plan, "cluster"), sink, f"plan @{plan.name}")
    if w is None or w.name in broken:
        return  # the workload's own errors are reported; matching layouts to it would cascade
    expected = w.model_stages()
    for ms, lay in plan.layouts.items():
        if ms not in expected:
            sink.error(lay.loc, f"layout {ms}: workload @{w.name} has no model-stage {ms}",
                       did_you_mean(ms, expected) or "model-stages: " + ", ".join(expected))
    missing = [ms for ms in expected if ms not in plan.layouts]
    if missing:
        sink.error(plan.loc, f"plan @{plan.name} has no layout for {', '.join(missing)}",
                   "every model-stage of the workload needs a layout")
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
        ok = [t for t in range(1, model.heads + 1) if model.heads % t == 0 and (t % model.kv_heads == 0 or model.kv_heads % t == 0)]
        sink.error(at(lay, "tp"), f"{ms}: tp = {lay.tp} does not divide heads = {model.heads} of model @{model.name}",
                   "choose tp from " + ", ".join(map(str, ok[:12])))
    elif lay.tp > model.kv_heads and lay.tp % model.kv_heads:
        sink.error(at(lay, "tp"), f"{ms}: tp = {lay.tp} is above kv_heads = {model.kv_heads} but not a multiple of it",
                   "K/V heads are replicated on tp / kv_heads ranks, which must be a whole number")
    elif lay.tp <= model.kv_heads and model.kv_heads % lay.tp:
        sink.error(at(lay, "tp"), f"{ms}: tp = {lay.tp} does not divide kv_heads = {model.kv_heads}")
    # pipeline layer ranges: one per stage, contiguous, covering every layer in order
    if len(lay.layers) != lay.pp:
        sink.error(at(lay, "layers"), f"{ms}: pp = {lay.pp} but layers lists {len(lay.layers)} range(s)",
                   "give one inclusive layer range per pipeline stage, e.g. [0..15, 16..31]")
    else:
        nxt = 0
        for lo, hi in lay.layers:
            if lo != nxt or hi < lo:
                sink.error(at(lay, "layers"), f"{ms}: pipeline stage layers {lo}..{hi} should start at layer {nxt}",
                           "stage ranges must be non-empty, in order, with no gap or overlap")
                break
            nxt = hi + 1
        else:
            if nxt != model.layers:
                sink.error(at(lay, "layers"), f"{ms}: layers cover 0..{nxt - 1} but model @{model.name} has {model.layers} layers (0..{model.layers - 1})")
    if len(lay.mesh) != lay.world:
        sink.error(at(lay, "mesh"), f"{ms}: mesh has {len(lay.mesh)} GPU(s) but "
                    + (f"dp x cp x pp x tp = {lay.dp} x {lay.cp} x" if lay.cp > 1 else f"dp x pp x tp = {lay.dp} x")
                    + f" {lay.pp} x {lay.tp} = {lay.world}")
    seen: set[int] = set()
    for g in lay.mesh:
        if g in seen:
            sink.error(at(lay, "mesh"), f"{ms}: GPU {g} appears twice in the mesh")
        seen.add(g)
        if cluster is not None:
            if g >= cluster.num_gpus:
                sink.error(at(lay, "mesh"), f"{ms}: GPU {g} does not exist: cluster @{cluster.name} has GPUs 0..{cluster.num_gpus - 1}")
            elif g in cluster.unavailable:
                sink.error(at(lay, "mesh"), f"{ms}: GPU {g} is unavailable in cluster @{cluster.name}")
    if not 0 <= lay.zero <= 3:
        sink.error(at(lay, "zero"), f"{ms}: zero = {lay.zero}; ZeRO stages are 0, 1, 2 and 3")
    train = stage is not None and stage.kind == "train"
    if lay.zero and not train:
        sink.error(at(lay, "zero"), f"{ms}: ZeRO shards training state, but {ms} does not train")
    if lay.recompute and not train:
        sink.error(at(lay, "recompute"), f"{ms}: activation recomputation applies only to training")
    if lay.sp and lay.tp == 1:
        sink.error(at(lay, "sp"), f"{ms}: sequence parallelism shards activations over TP, but tp = 1",
                   "set tp > 1 or drop sp")
    if lay.fp8 and cluster is not None and not cluster.peak_flops_fp8:
        sink.error(at(lay, "fp8"), f"{ms}: fp8 GEMMs need the FP8 peak of cluster @{cluster.name}",
                   "give the cluster peak_flops_fp8, e.g. 1979TFLOPs for an H100")
    if lay.grad_dtype != "bf16" and not train:
        sink.error(at(lay, "grad_dtype"), f"{ms}: only a training model-stage keeps gradients")
    if lay.vpp > 1:
        if stage is not None and stage.kind == "generate":
            sink.error(at(lay, "vpp"), f"{ms}: virtual pipeline stages are a training and inference schedule, not generation's")
        elif lay.pp < 2:
            sink.error(at(lay, "vpp"), f"{ms}: vpp = {lay.vpp} interleaves pipeline stages, but pp = {lay.pp}")
        elif len(lay.layers) == lay.pp and any((hi - lo + 1) % lay.vpp for lo, hi in lay.layers):
            sizes = ", ".join(str(hi - lo + 1) for lo, hi in lay.layers)
            sink.error(at(lay, "vpp"), f"{ms}: vpp = {lay.vpp} virtual stages do not divide the layers of every pipeline "
                                       f"stage ({sizes})", "choose vpp dividing every stage's layer count")
        elif lay.micro_batches % lay.pp:
            sink.error(at(lay, "vpp"), f"{ms}: the interleaved schedule needs micro_batches = {lay.micro_batches} to be a "
                                       f"multiple of pp = {lay.pp}", f"use micro_batches = {lay.micro_batches // lay.pp * lay.pp or lay.pp}")
    for what in lay.offload:
        if what in ("grads", "optimizer") and not train:
            sink.error(at(lay, "offload"), f"{ms}: only a training model-stage has {what} to offload")


def flush_samples(w, kind: str) -> int:
    """Samples one pipeline flush takes, over all DP replicas: a mini-batch when training (an
    optimizer step ends the flush), every sample of the step when only running forward."""
    return (w.mini_batch or w.samples) if kind == "train" else w.samples


def _verify_micro_batches(lay: Layout, w, stage, sink: DiagnosticSink) -> None:
    """A pipeline cannot split a flush into more micro-batches than the flush has."""
    if stage is None or stage.kind == "generate" or lay.pp == 1:
        return
    flush = flush_samples(w, stage.kind)
    need = lay.micro_batches * w.micro_batch * lay.dp
    if need > flush:
        most = flush // (w.micro_batch * lay.dp)
        what = "one mini-batch (mini_batch" + ("" if w.mini_batch else ", default: the step's samples") + ")" \
            if stage.kind == "train" else "the step (global_batch x group_size)"
        sink.error(at(lay, "micro_batches"),
                   f"{lay.model_stage}: micro_batches = {lay.micro_batches} x micro_batch = {w.micro_batch} x dp = "
                   f"{lay.dp} is {need} samples per pipeline flush, but {what} holds {flush}",
                   f"use micro_batches <= {most}" if most >= 1 else
                   f"dp = {lay.dp} replicas of micro_batch = {w.micro_batch} need more than {flush} samples: lower dp")


def _verify_context_parallel(lay: Layout, w, stage, sink: DiagnosticSink) -> None:
    """CP splits a training or inference pass's sequence into ``2 cp`` load-balanced causal
    chunks (two per rank, Megatron-LM's rule), so ``2 cp`` must divide the padded sequence."""
    if lay.cp == 1 or stage is None:
        return
    if stage.kind == "generate":
        sink.error(at(lay, "cp"), f"{lay.model_stage}: context parallelism splits a training or inference pass's "
                                  "sequence, not generation's", "drop cp on the generate stage")
        return
    seq = w.prompt_len_max + w.response_len_max
    if seq % (2 * lay.cp):
        ok = [c for c in range(2, 17) if seq % (2 * c) == 0]
        sink.error(at(lay, "cp"), f"{lay.model_stage}: cp = {lay.cp} splits each sequence into {2 * lay.cp} causal chunks, "
                                  f"which do not divide the sequence prompt_len_max + response_len_max = {seq}",
                   ("choose cp from " + ", ".join(map(str, ok))) if ok else "pad the sequence to a multiple of 2 x cp")


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
            sink.error(at(plan, "colocate"), "a colocate group joins model-stages of one stage: got stages " + ", ".join(sorted(stages)),
                       "model-stages of different stages run at different times and share GPUs without being colocated")
    for st in w.stages:
        seen: dict[int, str] = {}
        for ms in st.model_stages():
            lay = plan.layouts.get(ms)
            if lay is None:
                continue
            for g in lay.mesh:
                other = seen.get(g)
                if other is not None and other != ms and not plan.shares(other, ms):
                    sink.error(at(lay, "mesh"), f"GPU {g} is used by both {other} and {ms} in stage {st.name}",
                               f"add colocate = [[{other}, {ms}]] to run them one after another on shared GPUs")
                    break
                seen.setdefault(g, ms)
