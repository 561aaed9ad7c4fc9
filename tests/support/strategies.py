"""Hypothesis strategies that build whole ``nereus.ir.Module`` objects.

``modules()`` draws a cluster or two, a few small Llama-style models, a PPO or GRPO workload,
one or two plans with valid layouts, EMUs derived from those layouts with
``nereus.ir.sharding.derive_emus`` and transitions whose operations move real slices of those
EMUs (bytes and link computed the way the IR defines them).

``modules(valid=True)`` (the default) only builds modules that must pass ``nereus.verify``.
``modules(valid=False)`` additionally scrambles things the verifier rejects but the printer
and parser must still carry unchanged (GPUs of EMU shards shuffled away from the mesh, replicas
beyond ``dp``), for round-trip tests only.

``tiny_dims=True`` lets ``ffn`` and ``vocab`` be smaller than ``tp``, so some TP ranks hold an
empty slice (``[k:k]``) of a column/row/vocab-split tensor.

Sizes are kept small (a few layers, hidden sizes of tens, at most 24 GPUs) so that each
example parses, verifies and prints in milliseconds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from hypothesis import strategies as st

from nereus.ir import (
    Cluster,
    DiagnosticError,
    Emu,
    HostRef,
    Layout,
    Link,
    Model,
    Module,
    Op,
    Plan,
    Shard,
    ShardRef,
    SliceEntry,
    Stage,
    Transition,
    Workload,
)
from nereus.ir import cluster as _cluster_mod
from nereus.ir import model as _model_mod
from nereus.ir import plan as _plan_mod
from nereus.ir import transition as _transition_mod
from nereus.ir import workload as _workload_mod
from nereus.ir.model import state_dtype_bytes
from nereus.ir.sharding import derive_emus
from nereus.ir.units import Dim, UnitError, parse_quantity

# ---------------------------------------------------------------------------- names

# Words that are keywords or meaningful values somewhere in the language: they must still work
# as names of declarations and stages wherever the grammar expects a NAME or a SYMBOL.
KEYWORDS = [
    "cluster",
    "model",
    "workload",
    "stage",
    "plan",
    "layout",
    "emu",
    "shard",
    "gpus",
    "transition",
    "from",
    "to",
    "host",
    "grad",
    "master",
    "exp_avg",
    "exp_avg_sq",
    "weight",
    "true",
    "false",
    "link",
    "layers",
    "ppo",
    "grpo",
    "generate",
    "infer",
    "train",
    "bf16",
    "local",
    "nvlink",
    "pcie",
    "lm",
    "value",
    "time",
    "memory",
    "efficiency",
    "calibration",
    "gated",
    "plain",
    "score",
    "norm",
    "mlp",
    "self_attn",
]

identifiers = st.one_of(
    st.sampled_from(KEYWORDS),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True),
)

# ---------------------------------------------------------------------------- quantities

WRITTEN_UNITS = {
    Dim.SIZE: ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"],
    Dim.BANDWIDTH: ["B/s", "KB/s", "MB/s", "GB/s", "TB/s", "Kb/s", "Mb/s", "Gb/s", "Tb/s", "GiB/s", "MiB/s"],
    Dim.TIME: ["ns", "us", "ms", "s", "min", "h"],
    Dim.FLOPS: ["MFLOPs", "GFLOPs", "TFLOPs", "PFLOPs", "TFLOP/s"],
}

# Magnitudes (in base units) of "awkward" floats drawn directly; realistic hardware numbers.
FLOAT_RANGES = {
    Dim.BANDWIDTH: (1.0, 1e15),
    Dim.TIME: (1e-12, 1e6),
    Dim.FLOPS: (1e3, 1e18),
}


@st.composite
def written_quantity(draw, dim: Dim) -> int | float:
    """The value of a quantity as a person writes it: ``3.35TB/s``, ``400Gb/s``, ``2us``, ``80GiB``."""
    unit = draw(st.sampled_from(WRITTEN_UNITS[dim]))
    whole = draw(st.integers(1, 9999))
    frac = draw(st.one_of(st.just(""), st.from_regex(r"[0-9]{1,3}", fullmatch=True)))
    text = f"{whole}.{frac}{unit}" if frac else f"{whole}{unit}"
    try:
        return parse_quantity(text)[1]
    except UnitError:  # a fractional number of bytes: keep the whole part
        return parse_quantity(f"{whole}{unit}")[1]


def quantity(dim: Dim):
    """A positive quantity of ``dim``: as written by hand, or an arbitrary (awkward) value."""
    if dim is Dim.SIZE:
        raw = st.integers(1, 2**50)
    else:
        lo, hi = FLOAT_RANGES[dim]
        raw = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    return st.one_of(written_quantity(dim), raw)


# ---------------------------------------------------------------------------- schema-driven extras

_DIMS = {"size": Dim.SIZE, "bandwidth": Dim.BANDWIDTH, "time": Dim.TIME, "flops": Dim.FLOPS}

AWKWARD_FLOATS = [0.1 + 0.2, 1 / 3, 2 / 3, 1e-7, 0.7, 0.5, 1.0, 5e-324, 2.0**-30]


def value_for(spec):
    """A strategy for a value of attribute ``spec`` by its kind, or None for kinds drawn elsewhere.

    Used for optional attributes the strategies below do not build by hand (estimates, cost-model
    records, newer attributes): they must round-trip like every other attribute.
    """
    k = spec.kind
    if k == "size":
        return st.one_of(st.just(0), quantity(Dim.SIZE))
    if k in _DIMS:
        return st.one_of(st.just(0.0), quantity(_DIMS[k]))
    if k == "posint":
        return st.integers(1, 64)
    if k in ("int", "natural"):
        return st.integers(0, 64)
    if k == "float":
        return st.one_of(
            st.floats(0.0, 1.0, allow_nan=False), st.sampled_from(AWKWARD_FLOATS), st.floats(0.0, 1e6, allow_nan=False)
        )
    if k == "probability":
        return st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True, allow_nan=False))
    if k == "bool":
        return st.booleans()
    if k == "choice":
        return st.sampled_from(spec.choices)
    if k == "record" and getattr(spec, "record", None) is not None:
        return records(spec.record)
    return None


@st.composite
def records(draw, rec):
    """A record value (``link(...)``, ``time(...)``): required fields always, optional ones sometimes."""
    got = {}
    for f in rec.fields:
        strat = value_for(f)
        if strat is None:
            continue
        if f.required or draw(st.booleans()):
            got[f.key] = draw(strat)
    return rec.cls(**got)


def fill_optional(draw, node, specs, handled) -> None:
    """Give some optional attributes of ``node`` not in ``handled`` a non-default value."""
    for spec in specs:
        if spec.required or spec.key in handled or not hasattr(node, spec.key):
            continue
        strat = value_for(spec)
        if strat is not None and draw(st.booleans()):
            setattr(node, spec.key, draw(strat))


HANDLED = {
    "cluster": {
        "nodes",
        "gpus_per_node",
        "gpu_memory",
        "peak_flops",
        "hbm_bandwidth",
        "intra_node",
        "inter_node",
        "host_link",
        "host_memory",
        "unavailable",
    },
    "model": {
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "ffn",
        "vocab",
        "head_dim",
        "dtype",
        "tied_embeddings",
        "head",
        "trained",
        "experts",
        "experts_per_token",
        "expert_ffn",
        "shared_expert_ffn",
        "dense_layers",
        "moe_naming",
    },
    "workload": {
        "algorithm",
        "roles",
        "global_batch",
        "group_size",
        "prompt_len_mean",
        "prompt_len_max",
        "response_len_mean",
        "response_len_max",
        "ppo_epochs",
        "mini_batch",
        "micro_batch",
        "steps",
    },
    "stage": {"kind", "models"},
    "plan": {"workload", "cluster", "colocate"},
    "layout": {
        "tp",
        "pp",
        "dp",
        "layers",
        "mesh",
        "micro_batches",
        "zero",
        "recompute",
        "offload",
        "time",
        "memory",
        "sp",
        "vpp",
        "grad_dtype",
        "fp8",
        "cp",
        "ep",
        "etp",
        "schedule",
        "tp_overlap",
        "pp_overlap",
        "dp_overlap",
        "attention",
    },  # vpp, fp8, cp: tests/ir/test_layout_features.py; schedule and the overlaps, attention: tests/passes/
    "transition": {"source", "target"},
    "op": {"bytes", "link", "deps", "start", "duration"},
}


@st.composite
def links(draw) -> Link:
    return Link(bandwidth=draw(quantity(Dim.BANDWIDTH)), latency=draw(quantity(Dim.TIME)))


# ---------------------------------------------------------------------------- cluster


@st.composite
def clusters(draw, name: str) -> Cluster:
    nodes = draw(st.integers(1, 3))
    gpn = draw(st.integers(1, 8))
    n = nodes * gpn
    unavailable = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=min(n - 1, 4)))
    if draw(st.booleans()):
        unavailable.sort()
    c = Cluster(
        name=name,
        nodes=nodes,
        gpus_per_node=gpn,
        gpu_memory=draw(quantity(Dim.SIZE)),
        peak_flops=draw(quantity(Dim.FLOPS)),
        hbm_bandwidth=draw(quantity(Dim.BANDWIDTH)),
        intra_node=draw(links()),
        inter_node=draw(links()),
        host_link=draw(st.none() | links()),
        host_memory=draw(st.none() | quantity(Dim.SIZE)),
        unavailable=unavailable,
    )
    fill_optional(draw, c, _cluster_mod.CLUSTER_ATTRS, HANDLED["cluster"])
    return c


# ---------------------------------------------------------------------------- models


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tps(model: Model) -> list[int]:
    """TP degrees the verifier accepts for ``model``: divide heads, compatible with kv_heads."""
    return [
        t
        for t in divisors(model.heads)
        if (t > model.kv_heads and t % model.kv_heads == 0) or (t <= model.kv_heads and model.kv_heads % t == 0)
    ]


@st.composite
def models(draw, name: str, head: str = "lm", trained: bool = False, tiny_dims: bool = False) -> Model:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    kv_heads = draw(st.sampled_from(divisors(heads)))
    head_dim = draw(st.none() | st.integers(1, 8))
    hidden = heads * draw(st.integers(1, 6)) if head_dim is None else draw(st.integers(1, 40))
    # tp <= heads; with ffn, vocab >= heads no TP rank is left with an empty slice
    lo, hi = (1, 6) if tiny_dims else (heads, 40)
    tied = False if head == "value" else draw(st.booleans())
    md = Model(
        name=name,
        layers=draw(st.integers(1, 6)),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=draw(st.integers(lo, hi)),
        vocab=draw(st.integers(lo, hi + 24)),
        head_dim=head_dim,
        dtype=draw(st.sampled_from(["bf16", "fp32", "fp16", "fp8"])),
        tied_embeddings=tied,
        head=head,
        trained=trained,
    )
    fill_optional(draw, md, _model_mod.MODEL_ATTRS, HANDLED["model"])
    if draw(st.integers(0, 3)) == 0:  # a mixture of experts, every layer (its experts are SwiGLU)
        md.experts = draw(st.integers(2, 5))
        md.experts_per_token = draw(st.integers(1, md.experts))
        md.expert_ffn = draw(st.integers(lo, hi))
        md.moe_naming = draw(st.sampled_from(["qwen", "mixtral"]))
        if md.moe_naming == "qwen" and draw(st.booleans()):
            md.shared_expert_ffn = draw(st.integers(lo, hi))
        if md.layers > 1 and draw(st.booleans()):
            md.dense_layers = draw(st.integers(1, md.layers - 1))
        md.mlp = "gated"
    return md


# ---------------------------------------------------------------------------- workload


@st.composite
def workloads(draw, name: str, mods: list[Model], algorithm: str) -> Workload:
    roles = draw(st.permutations([md.name for md in mods]))
    by_name = {md.name: md for md in mods}
    eligible = {
        "generate": [r for r in roles if by_name[r].head == "lm"],
        "infer": list(roles),
        "train": [r for r in roles if by_name[r].trained],
    }
    stage_names = draw(st.lists(identifiers, unique=True, min_size=1, max_size=3))
    stages = []
    for sname in stage_names:
        kind = draw(st.sampled_from(["generate", "infer", "train"]))
        if not eligible[kind]:
            kind = "infer"
        ms = draw(st.lists(st.sampled_from(eligible[kind]), unique=True, min_size=1))
        stage = Stage(name=sname, kind=kind, models=ms)
        fill_optional(draw, stage, _workload_mod.STAGE_ATTRS, HANDLED["stage"])
        stages.append(stage)
    if algorithm == "ppo":
        critics = [r for r in eligible["train"] if by_name[r].head == "value"]
        assert critics, "a PPO module needs a trained value-head model"
        train = [s for s in stages if s.kind == "train"]
        if train:
            if not any(r in critics for s in train for r in s.models):
                train[0].models.append(critics[0])
        else:
            sname = draw(identifiers.filter(lambda x: x not in stage_names))
            stages.append(Stage(name=sname, kind="train", models=[critics[0]]))
    global_batch = draw(st.integers(1, 64))
    group_size = draw(st.integers(2, 8)) if algorithm == "grpo" else draw(st.sampled_from([1, 1, 2, 4]))
    samples = global_batch * group_size
    prompt_max = draw(st.integers(1, 4096))
    response_max = draw(st.integers(1, 8192))
    mini_batch = draw(st.none() | st.sampled_from(divisors(samples)))
    w = Workload(
        name=name,
        algorithm=algorithm,
        roles=roles,
        global_batch=global_batch,
        group_size=group_size,
        prompt_len_mean=draw(st.integers(1, prompt_max)),
        prompt_len_max=prompt_max,
        response_len_mean=draw(st.integers(1, response_max)),
        response_len_max=response_max,
        ppo_epochs=draw(st.integers(1, 4)),
        mini_batch=mini_batch,
        micro_batch=draw(st.sampled_from(divisors(mini_batch or samples))),  # batch sizes nest, as the verifier asks
        steps=draw(st.none() | st.integers(1, 100_000)),
        stages=stages,
    )
    fill_optional(draw, w, _workload_mod.WORKLOAD_ATTRS, HANDLED["workload"])
    return w


# ---------------------------------------------------------------------------- plans


@st.composite
def layouts(draw, model_stage: str, model: Model, pool: list[int], trains: bool) -> Layout:
    """A valid layout of ``model_stage`` on (a subset of) the GPUs of ``pool``."""
    tp = draw(st.sampled_from([t for t in valid_tps(model) if t <= len(pool)]))
    pp = draw(st.integers(1, min(model.layers, len(pool) // tp)))
    dp = draw(st.integers(1, len(pool) // (tp * pp)))
    cuts = (
        sorted(draw(st.lists(st.integers(1, model.layers - 1), unique=True, min_size=pp - 1, max_size=pp - 1)))
        if pp > 1
        else []
    )
    bounds = [0] + cuts + [model.layers]
    layer_ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(pp)]
    mesh = draw(st.permutations(pool))[: tp * pp * dp]
    if draw(st.booleans()):
        mesh.sort()  # contiguous meshes print as ranges: [0..7]
    offload_choices = ["weights", "grads", "optimizer"] if trains else ["weights"]
    lay = Layout(
        model_stage=model_stage,
        tp=tp,
        pp=pp,
        dp=dp,
        layers=layer_ranges,
        mesh=mesh,
        micro_batches=draw(st.integers(1, 16)),
        zero=draw(st.integers(0, 3)) if trains else 0,
        recompute=draw(st.booleans()) if trains else False,
        sp=draw(st.booleans()) if tp > 1 else False,
        grad_dtype=draw(st.sampled_from(["bf16", "fp32"])) if trains else "bf16",
        offload=draw(st.lists(st.sampled_from(offload_choices), unique=True, max_size=len(offload_choices))),
        time=draw(st.none() | quantity(Dim.TIME)),
        memory=draw(st.none() | quantity(Dim.SIZE)),
    )
    if model.moe and draw(st.booleans()):
        # EP x ETP carved from the TP ranks alone, so that it divides dp x cp x tp whatever DP becomes
        lay.etp = draw(st.sampled_from([t for t in range(1, tp + 1) if tp % t == 0]))
        e = cast(int, model.experts)
        lay.ep = draw(
            st.sampled_from([k for k in range(1, tp // lay.etp + 1) if (tp // lay.etp) % k == 0 and e % k == 0])
        )
    if trains and lay.sp:  # Megatron-LM overlaps TP communication only under sequence parallelism
        lay.tp_overlap = draw(st.booleans())
    if trains and pp > 1 and all((hi - lo + 1) % 2 == 0 for lo, hi in layer_ranges) and draw(st.booleans()):
        # two chunks per rank: the schedules that run them (interleaved's micro-batches: fit_flush)
        lay.vpp = 2
        lay.schedule = draw(st.sampled_from([None, "interleaved", "zero_bubble", "zbv"]))
    elif trains and pp > 1:  # one stage per rank: the schedules that run it
        lay.schedule = draw(st.sampled_from([None, "one_f_one_b", "gpipe", "zero_bubble"]))
    if trains and pp > 1:  # pipeline sends: the schedule's default (None), or what it can run
        runs = {"one_f_one_b": [None, False], "interleaved": [None, True, False]}
        lay.pp_overlap = draw(st.sampled_from(runs.get(lay.pipeline_schedule, [None, True])))
    if trains:
        lay.dp_overlap = draw(st.booleans())
        # selective recomputation of the attention core only where full recomputation is off
        lay.attention = draw(st.sampled_from(["flash", "materialized"] + ([] if lay.recompute else ["recomputed"])))
    fill_optional(draw, lay, _plan_mod.LAYOUT_ATTRS, HANDLED["layout"])
    return lay


def fit_flush(lay: Layout, w: Workload, kind: str) -> Layout:
    """``lay`` made a pipeline can run: no more micro-batches than one flush holds per replica
    (a mini-batch when training, the step otherwise); fewer DP replicas, or no pipeline, where
    even one micro-batch per replica is too many."""
    if lay.pp == 1 or kind == "generate":
        return lay
    flush = (w.mini_batch or w.samples) if kind == "train" else w.samples
    if flush < w.micro_batch:  # not one micro-batch per flush: no pipeline
        lay.pp, lay.layers = 1, [(0, lay.layers[-1][1])]
    else:
        lay.dp = min(lay.dp, flush // w.micro_batch)
        lay.micro_batches = min(lay.micro_batches, flush // (w.micro_batch * lay.dp))
    lay.mesh = lay.mesh[: lay.tp * lay.pp * lay.dp]
    m = lay.micro_batches
    if lay.pp == 1 or (lay.schedule == "zero_bubble" and m % max(1, m // lay.pp)):
        lay.schedule = None  # no pipeline left, or micro-batches torch's rounds do not divide
    if lay.vpp > 1 and (lay.pp == 1 or (lay.pipeline_schedule == "interleaved" and m % lay.pp)):
        lay.vpp, lay.schedule = 1, None  # Megatron's interleaving needs a multiple of pp micro-batches
    posts = {"one_f_one_b": (False,), "interleaved": (True, False)}.get(lay.pipeline_schedule, (True,))
    if lay.pp == 1 or (lay.pp_overlap is not None and lay.pp_overlap not in posts):
        lay.pp_overlap = None  # the pipeline sends as the schedule left runs them
    return lay


@st.composite
def plans(draw, name: str, workload: Workload, cluster: Cluster, by_name: dict[str, Model]) -> Plan:
    avail = cluster.available_gpus()
    lays: dict[str, Layout] = {}
    colocate: list[list[str]] = []
    for stage in workload.stages:
        mss = stage.model_stages()
        # split the model-stages of this stage into groups; each group gets its own GPUs, and
        # the members of a group (listed in colocate when it has two or more) may share them
        ngroups = draw(st.integers(1, min(len(mss), len(avail))))
        assign = [draw(st.integers(0, ngroups - 1)) for _ in mss]
        groups = [[ms for ms, g in zip(mss, assign) if g == i] for i in range(ngroups)]
        groups = [g for g in groups if g]
        shuffled = draw(st.permutations(avail))
        cuts = (
            sorted(
                draw(
                    st.lists(
                        st.integers(1, len(avail) - 1), unique=True, min_size=len(groups) - 1, max_size=len(groups) - 1
                    )
                )
            )
            if len(groups) > 1
            else []
        )
        bounds = [0] + cuts + [len(avail)]
        for i, group in enumerate(groups):
            pool = shuffled[bounds[i] : bounds[i + 1]]
            for ms in group:
                model = by_name[ms.rpartition(".")[0]]
                lays[ms] = fit_flush(draw(layouts(ms, model, pool, stage.kind == "train")), workload, stage.kind)
                if cluster.host_link is None or cluster.host_memory is None:  # nowhere to offload to
                    lays[ms].offload = []
            if len(group) > 1 or draw(st.integers(0, 5)) == 0:  # singleton groups are legal too
                colocate.append(list(group))
    order = draw(st.permutations(list(lays)))
    plan = Plan(
        name=name,
        workload=workload.name,
        cluster=cluster.name,
        colocate=colocate,
        layouts={ms: lays[ms] for ms in order},
    )
    fill_optional(draw, plan, _plan_mod.PLAN_ATTRS, HANDLED["plan"])
    return plan


# ---------------------------------------------------------------------------- EMUs


def _split_entry(model: Model, e: SliceEntry, how: str) -> list[SliceEntry] | None:
    """Two entries that together hold exactly what ``e`` holds, or None when ``e`` cannot be split so."""
    if how == "layers" and e.layers is not None and e.layers[1] > e.layers[0]:
        lo, hi = e.layers
        mid = (lo + hi) // 2
        return [
            SliceEntry(family=e.family, layers=(lo, mid), box=e.box, state=e.state),
            SliceEntry(family=e.family, layers=(mid + 1, hi), box=e.box, state=e.state),
        ]
    d = model.tensors[e.family].tp_dim
    if how == "box" and d is not None and e.box[d][1] - e.box[d][0] >= 2:
        a, b = e.box[d]
        mid = (a + b) // 2
        left = tuple((a, mid) if i == d else s for i, s in enumerate(e.box))
        right = tuple((mid, b) if i == d else s for i, s in enumerate(e.box))
        return [
            SliceEntry(family=e.family, layers=e.layers, box=left, state=e.state),
            SliceEntry(family=e.family, layers=e.layers, box=right, state=e.state),
        ]
    return None


@st.composite
def emus_of(draw, plan: Plan, layout: Layout, model: Model, trains: bool, valid: bool) -> list[Emu]:
    """EMUs of some replicas of ``layout``, derived with ``derive_emus``.

    Sometimes a replica's slice lists are changed in a way that holds the same elements
    (entries reordered, an entry split in two) so that it no longer prints in one block with
    the other replicas. With ``valid=False`` the GPUs of the shards may be shuffled away from
    the mesh and a replica beyond ``dp`` may appear.
    """
    states = ["weight"]
    if trains:
        states += draw(st.lists(st.sampled_from(["grad", "master", "exp_avg", "exp_avg_sq"]), unique=True, max_size=4))
        states = draw(st.permutations(states))
    emus = derive_emus(plan.name, model, layout, tuple(states))
    keep = draw(
        st.one_of(st.just(list(range(layout.dp))), st.lists(st.sampled_from(range(layout.dp)), unique=True, min_size=1))
    )
    emus = [e for e in emus if e.replica in keep]
    for n, emu in enumerate(emus):
        change = draw(st.sampled_from(["none", "none", "none", "reorder", "layers", "box"]))
        if change == "none":
            continue
        which = draw(st.integers(0, len(emu.shards) - 1))
        shard = emu.shards[which]
        entries = list(shard.entries)  # derive_emus shares one tuple between replicas
        if change == "reorder":
            entries = draw(st.permutations(entries))
        elif entries:  # a shard may hold nothing (a GPU of the mesh with no slice of these states)
            i = draw(st.integers(0, len(entries) - 1))
            parts = _split_entry(model, entries[i], change)
            if parts is not None:
                entries[i : i + 1] = parts
        shards = list(emu.shards)
        shards[which] = replace(shard, entries=entries)  # EMUs are frozen: a changed one is a new one
        emus[n] = replace(emu, shards=shards)
    if not valid:
        for n, emu in enumerate(emus):
            if draw(st.booleans()):
                gpus = draw(st.permutations([s.gpu for s in emu.shards]))
                if draw(st.booleans()):
                    gpus = [draw(st.integers(0, 64)) for _ in gpus]
                emus[n] = replace(emu, shards=[replace(s, gpu=g) for s, g in zip(emu.shards, gpus)])
        if draw(st.integers(0, 3)) == 0:
            extra = derive_emus(plan.name, model, layout, ("weight",))[0]
            extra = replace(extra, replica=layout.dp + draw(st.integers(0, 3)))
            if draw(st.integers(0, 2)) == 0:
                extra = replace(extra, shards=())  # an emu block with no shard at all
            elif draw(st.booleans()):
                extra = replace(
                    extra, shards=(replace(extra.shards[0], entries=()), *extra.shards[1:])
                )  # a shard with no slice
            emus.append(extra)
    return emus


# ---------------------------------------------------------------------------- transitions


class Slot:
    """An endpoint that holds state: one shard of one EMU."""

    def __init__(self, emu: Emu, shard: Shard, model: Model):
        self.ref = ShardRef(emu.model_stage, emu.replica, shard.pp, shard.tp)
        self.gpu = shard.gpu
        self.entries = shard.entries
        self.model = model


def _slots(m: Module, plan: Plan) -> list[Slot]:
    out = []
    for emu in m.emus.values():
        if emu.plan == plan.name:
            model = m.models[plan.layouts[emu.model_stage].model]
            out.extend(Slot(emu, s, model) for s in emu.shards if s.entries)
    return out


def _box_inter(a, b):
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _layer_inter(a, b):
    if a is None or b is None:
        return a if a == b else False
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo <= hi else False


def _region(e: SliceEntry):
    return (e.layers, e.box)


def _inter(region, e: SliceEntry):
    """Intersection of ``region`` (layers, box) with entry ``e``; None when empty."""
    layers = _layer_inter(region[0], e.layers)
    if layers is False:
        return None
    box = _box_inter(region[1], e.box)
    return None if box is None else (layers, box)


def _holders(slots: list[Slot], model: Model, state: str, family: str, region):
    """(slot, intersection) for every slot of ``model`` holding part of ``region``."""
    out = []
    for s in slots:
        if s.model.name != model.name:
            continue
        for e in s.entries:
            if e.state == state and e.family == family:
                r = _inter(region, e)
                if r is not None:
                    out.append((s, r))
    return out


def _contained(slot: Slot, state: str, family: str, region) -> bool:
    layers, box = region
    for e in slot.entries:
        if e.state != state or e.family != family:
            continue
        if layers is not None and (e.layers is None or e.layers[0] > layers[0] or e.layers[1] < layers[1]):
            continue
        if all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(e.box, box)):
            return True
    return False


@st.composite
def sub_region(draw, region):
    """A non-empty sub-slice of ``region`` (often the whole of it)."""
    layers, box = region
    if draw(st.booleans()):
        return region
    if layers is not None:
        lo = draw(st.integers(layers[0], layers[1]))
        layers = (lo, draw(st.integers(lo, layers[1])))
    out = []
    for lo, hi in box:
        a = draw(st.integers(lo, hi - 1))
        out.append((a, draw(st.integers(a + 1, hi))))
    return layers, tuple(out)


def _link(cluster: Cluster, gpus: list[int]) -> str:
    if len(set(gpus)) == 1:
        return "local"
    return "nic" if len({cluster.node_of(g) for g in gpus}) > 1 else "nvlink"


@st.composite
def ops(
    draw, src_slots: list[Slot], dst_slots: list[Slot], cluster: Cluster, opid: str, earlier: list[str]
) -> Op | None:
    kind = draw(st.sampled_from(["send", "copy", "broadcast", "free", "offload", "load"]))
    if kind == "load" or not src_slots:
        if not dst_slots:
            return None
        kind = "load"
    if kind == "load":
        dst = draw(st.sampled_from(dst_slots))
        e = draw(st.sampled_from(dst.entries))
        layers, box = draw(sub_region(_region(e)))
        src, dsts, model, link = [HostRef(dst.gpu)], [dst.ref], dst.model, "pcie"
    else:
        s = draw(st.sampled_from(src_slots))
        e = draw(st.sampled_from(s.entries))
        model = s.model
        region = _region(e)
        if kind in ("send", "copy", "broadcast"):
            cands = _holders(dst_slots, model, e.state, e.family, region)
            if not cands:
                kind = draw(st.sampled_from(["free", "offload"]))
        if kind in ("send", "copy", "broadcast"):
            d, r = draw(st.sampled_from(cands))
            layers, box = draw(sub_region(r))
            targets = [d]
            if kind == "broadcast":
                more = [
                    c
                    for c, _ in _holders(dst_slots, model, e.state, e.family, (layers, box))
                    if c.ref != d.ref and _contained(c, e.state, e.family, (layers, box))
                ]
                if more:
                    targets += draw(st.lists(st.sampled_from(more), unique_by=lambda c: c.ref, max_size=3))
            src, dsts = [s.ref], [x.ref for x in targets]
            link = _link(cluster, [s.gpu] + [x.gpu for x in targets])
        if kind == "free":
            layers, box = draw(sub_region(region))
            more = [
                c
                for c in src_slots
                if c.ref != s.ref and c.model.name == model.name and _contained(c, e.state, e.family, (layers, box))
            ]
            extra = draw(st.lists(st.sampled_from(more), unique_by=lambda c: c.ref, max_size=2)) if more else []
            src, dsts, link = [s.ref] + [c.ref for c in extra], [], "local"
        elif kind == "offload":
            layers, box = draw(sub_region(region))
            src, dsts, link = [s.ref], [HostRef(s.gpu)], "pcie"
    state = e.state
    numel = 1 if layers is None else layers[1] - layers[0] + 1
    for lo, hi in box:
        numel *= hi - lo
    op = Op(
        id=opid,
        kind=kind,
        family=e.family,
        layers=layers,
        box=box,
        bytes=numel * state_dtype_bytes(model, state),
        link=link,
        state=state,
        src=src,
        dst=dsts,
        deps=draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else [],
        start=draw(st.none() | st.just(0.0) | quantity(Dim.TIME)),
        duration=draw(st.none() | quantity(Dim.TIME)),
    )
    fill_optional(draw, op, _transition_mod.OP_ATTRS, HANDLED["op"])
    return op


@st.composite
def transitions(draw, name: str, m: Module, source: Plan, target: Plan, valid: bool = True) -> Transition:
    src_slots, dst_slots = _slots(m, source), _slots(m, target)
    cluster = m.clusters[target.cluster]
    ids = draw(st.lists(st.from_regex(r"%[A-Za-z0-9_]{1,4}", fullmatch=True), unique=True, max_size=6))
    out: list[Op] = []
    for opid in ids:
        op = draw(ops(src_slots, dst_slots, cluster, opid, [o.id for o in out]))
        if op is not None:
            out.append(op)
    if not valid:
        for op in out:
            if draw(st.integers(0, 4)) == 0:  # endpoints are optional in the grammar
                op.src, op.dst = draw(st.sampled_from([([], []), (op.src, []), ([], op.dst)]))
    t = Transition(name=name, source=source.name, target=target.name, ops=out)
    fill_optional(draw, t, _transition_mod.TRANSITION_ATTRS, HANDLED["transition"])
    return t


# ---------------------------------------------------------------------------- modules


@st.composite
def modules(draw, valid: bool = True, tiny_dims: bool = False) -> Module:
    n_models = draw(st.integers(1, 4))
    n_clusters = draw(st.integers(1, 2))
    n_plans = draw(st.integers(1, 2))
    n_trans = draw(st.integers(0, 2))
    names = draw(
        st.lists(
            identifiers,
            unique=True,
            min_size=n_models + n_clusters + 1 + n_plans + n_trans,
            max_size=n_models + n_clusters + 1 + n_plans + n_trans,
        )
    )
    model_names, names = names[:n_models], names[n_models:]
    cluster_names, names = names[:n_clusters], names[n_clusters:]
    workload_name, names = names[0], names[1:]
    plan_names, trans_names = names[:n_plans], names[n_plans:]

    algorithm = draw(st.sampled_from(["ppo", "grpo"]))
    mods = []
    for i, mname in enumerate(model_names):
        if algorithm == "ppo" and i == n_models - 1:
            head, trained = "value", True  # the critic
        else:
            head = draw(st.sampled_from(["lm", "lm", "value"]))
            trained = draw(st.booleans())
        mods.append(draw(models(mname, head=head, trained=trained, tiny_dims=tiny_dims)))
    by_name = {md.name: md for md in mods}
    cls = [draw(clusters(n)) for n in cluster_names]
    w = draw(workloads(workload_name, mods, algorithm))
    m = Module()
    for c in draw(st.permutations(cls)):
        m.clusters[c.name] = c
    for md in draw(st.permutations(mods)):
        m.models[md.name] = md
    m.workloads[w.name] = w

    kinds = {ms: st_.kind for st_ in w.stages for ms in st_.model_stages()}
    for pname in plan_names:
        cluster = draw(st.sampled_from(cls))
        plan = draw(plans(pname, w, cluster, by_name))
        m.plans[pname] = plan
        for ms, lay in plan.layouts.items():
            if draw(st.integers(0, 2)) == 0:
                continue
            for emu in draw(emus_of(plan, lay, by_name[lay.model], kinds[ms] == "train", valid)):
                m.emus[emu.key] = emu

    plan_list = list(m.plans.values())
    for tname in trans_names:
        source = draw(st.sampled_from(plan_list))
        same = [p for p in plan_list if p.cluster == source.cluster]
        target = draw(st.sampled_from(same))
        if valid:
            # A valid transition leaves every destination EMU complete (a verifier rule), which
            # random operations do not: let the planner build it, with random scheduling fields.
            from nereus.passes.transition.derive_emus import derive_missing_emus
            from nereus.passes.transition.plan_transition import plan_transition

            try:
                for plan in (source.name, target.name):
                    derive_missing_emus(m, plan)
                t = plan_transition(m, source.name, target.name, tname)
            except DiagnosticError:
                continue  # e.g. a 1-byte GPU: no order fits, or the plans carry different state
            for op in t.ops:
                op.start = draw(st.none() | st.just(0.0) | quantity(Dim.TIME))
            m.transitions[tname] = t
        else:
            m.transitions[tname] = draw(transitions(tname, m, source, target, valid))
    return m
