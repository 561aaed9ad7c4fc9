"""The adapter between a live HF Llama + AdamW and Nereus's shards: export, import, and the check.

``export_state(live, module, plan)`` is this rank's state as a ``LocalState`` keyed exactly as
``plan_layout(module, plan)[rank]`` lists it for the live model-stage: ``weight``, ``master``,
``exp_avg`` and ``exp_avg_sq`` of every tensor (IR names: ``layers.3.mlp.up_proj.weight``, no
``model.`` prefix), each the rank-local shard of the parameter or of AdamW's state (a view: no
copy, and ``execute`` never writes its input). AdamW's ``step`` is a scalar and travels apart,
as an int: the same on every parameter and every rank.

``master``: the live model trains in fp32, so the parameter is the master weight. The IR still
lists a separate fp32 ``master`` for a trained model (``ir.sharding.states_of`` does not look at
the dtype); export gives the parameter itself for both keys, and import requires the two to be
bit-identical (they are whenever they came from one export, since transitions copy bytes).

``load_state(live, module, plan, state, step)`` writes a ``LocalState`` into a freshly built
model and optimizer (``hf_llama.build``) in place; ``buffers`` are the live tensors themselves,
for ``execute(..., out=...)`` to fill directly.

Every box is checked: the box a live tensor covers (recorded at build from its DTensor
placements on the tp sub-mesh, ``LiveLlama.boxes``) must be the box the plan's EMUs give the rank.
``check_layout`` says, before any state moves, where the live model cannot take a layout.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backend.shards import ShardSpec, StateKey, plan_layout
from ..ir import Diagnostic, DiagnosticError, Module, bare_name
from ..ir.diagnostics import plural
from ..ir.sharding import states_of
from ..runtime.dtensor import placements
from ..runtime.state import LocalState, torch_dtype
from .hf_llama import LiveLlama, local
from .job import layout as job_layout

ADAM_STATES = ("exp_avg", "exp_avg_sq")


def check_layout(module: Module, plan: str, model_stage: str) -> None:
    """Raise ``DiagnosticError`` where the live HF model cannot take ``plan``'s layout of
    ``model_stage``; pure IR, so every rank raises the same error without a message."""
    plan = bare_name(plan)
    lay = module.plans[plan].layouts[model_stage]
    stage = module.workloads[module.plans[plan].workload].stage_of(model_stage)
    problems = layout_problems(
        module.models[lay.model], stage.kind if stage else "", lay, f"plan @{plan} {model_stage}"
    )
    if problems:
        raise DiagnosticError(problems)


def live_keep(module: Module):
    """plan-search's ``keep`` for a live job of HF Llamas: of each model-stage's options, those
    ``check_layout`` accepts (generation: vLLM's engines, one pipeline stage), so that the search
    proposes only layouts the live job can take; every stage splits the step's sequences evenly
    over its DP replicas (``stage_data.rows``), so a DP that does not divide them is dropped."""
    w = next(iter(module.workloads.values()))
    sequences = w.global_batch * w.group_size

    def keep(ms, options, n):
        st = w.stage_of(ms)
        if st is None:
            return options
        if st.kind == "generate":
            return [o for o in options if o.pp == 1]
        model = module.models[ms.split(".")[0]]
        return [
            o
            for o in options
            if sequences % o.dp == 0
            and not layout_problems(
                model,
                st.kind,
                job_layout(model, tp=o.tp, dp=o.dp, pp=o.pp, micro_batches=o.micro_batches, stage=st.name, zero=o.zero),
                ms,
            )
        ]

    return keep


def layout_problems(model, kind: str, lay, where: str) -> list[Diagnostic]:
    """What keeps the live HF model from taking layout ``lay`` of a ``kind`` stage (``where``
    starts each message)."""
    at = lambda attr: lay.locs.get(attr, lay.loc)  # noqa: E731
    problems: list[Diagnostic] = []

    def bad(attr, msg, hint=None):
        problems.append(Diagnostic(at(attr), f"{where}: {msg}", hint))

    if lay.pp > 1 and lay.micro_batches < lay.pp:
        bad(
            "micro_batches",
            f"micro_batches = {lay.micro_batches} with pp = {lay.pp}: PyTorch's Schedule1F1B "
            "needs at least as many micro-batches as pipeline stages",
            f"use micro_batches >= {lay.pp}",
        )
    if lay.zero in (1, 2):
        bad(
            "zero",
            f"zero = {lay.zero}: the adapter's ZeRO is FSDP2, which keeps the weights sharded over DP between "
            "steps (ZeRO-3); ZeRO-1/2 keep them whole",
            "use zero = 0 (DDP) or zero = 3 (FSDP2)",
        )
    elif lay.zero == 3 and lay.dp > 1:
        if not model.trained:
            bad("zero", f"zero = 3 on the frozen model @{model.name}: the adapter shards only trained models")
        if lay.pp > 1:
            bad("zero", f"zero = 3 with pp = {lay.pp}: FSDP2 under pipeline stages is not built", "use pp = 1")
        for family, spec in model.tensors.items():  # FSDP2 splits dim 0 of each TP shard with torch.chunk
            rows = spec.shape[0] // lay.tp if spec.tp_dim == 0 else spec.shape[0]
            if rows % lay.dp:
                bad(
                    "zero",
                    f"zero = 3: {family} has {rows} rows per TP shard, which FSDP2 splits over DP {lay.dp} "
                    "by torch.chunk and the IR evenly: they differ unless DP divides them",
                )
                break
    if model.dtype != "fp32":
        problems.append(
            Diagnostic(model.loc, f"model @{model.name}: dtype = {model.dtype}; the adapter trains in fp32")
        )
    if model.tied_embeddings or model.mlp != "gated":
        problems.append(
            Diagnostic(
                model.loc,
                f"model @{model.name}: the adapter takes an untied Hugging Face Llama "
                "(tied_embeddings = false, mlp = gated; head = lm or value)",
            )
        )
    hint = "choose tp from " + ", ".join(
        str(t) for t in range(1, model.kv_heads + 1) if model.heads % t == 0 and model.kv_heads % t == 0
    )
    if model.heads % lay.tp:
        bad(
            "tp",
            f"tp = {lay.tp} does not divide heads = {model.heads}: HF attention under ColwiseParallel "
            "needs whole query heads on every TP rank",
            hint,
        )
    elif model.kv_heads % lay.tp:
        why = (
            f"the IR replicates each K/V head on {lay.tp // model.kv_heads} TP ranks, which is no DTensor "
            "placement, and ColwiseParallel would cut K/V heads apart"
            if lay.tp > model.kv_heads
            else "ColwiseParallel would cut K/V heads apart"
        )
        bad("tp", f"tp = {lay.tp} does not divide kv_heads = {model.kv_heads}: {why}", hint)
    else:  # whole heads everywhere: what remains is torch.chunk against tensor_split (uneven ffn, vocab)
        seen = set()
        for state in states_of(model, kind):
            for family in model.tensors:
                pl = placements(model, dataclasses.replace(lay, zero=0) if lay.zero == 3 else lay, family, state)
                if pl.placements is None and pl.reason not in seen:
                    seen.add(pl.reason)
                    bad("tp", f"DTensor cannot express the layout: {pl.reason}")
    return problems


def shard_specs(live: LiveLlama, module: Module, plan: str) -> list[ShardSpec]:
    """This GPU's shards of ``live``'s model-stage under ``plan``."""
    return [s for s in plan_layout(module, plan).get(live.gpu, []) if s.key.model_stage == live.layout.model_stage]


def live_tensor(live: LiveLlama, params: dict, spec: ShardSpec) -> torch.Tensor:
    """This rank's tensor (parameter or AdamW state, rank-local) that holds ``spec``; its full
    shape and box are the ones the live model recorded at build (``LiveLlama.boxes``)."""
    p = params.get(spec.key.tensor)
    if p is None:
        raise KeyError(f"{spec.key}: the live model has no parameter {spec.key.tensor}")
    t = local(p if spec.key.state in ("weight", "master") else live.optimizer.state[p][spec.key.state])
    shape, box = live.boxes[spec.key.tensor]
    extent = tuple(hi - lo for lo, hi in box)
    if (shape, box) != (spec.shape, tuple(spec.box)) or tuple(t.shape) != extent or t.dtype != torch_dtype(spec.dtype):
        raise ValueError(
            f"{spec.key}: the live tensor is {tuple(t.shape)} {t.dtype} holding {box} of {shape} on "
            f"this rank; the plan says {spec.dtype} holding {spec.box} of {spec.shape}"
        )
    return t


def buffers(live: LiveLlama, module: Module, plan: str) -> LocalState:
    """The live tensors (rank-local views) that hold ``plan``'s shards on this rank, ``master``
    left out (it is the weight's buffer): what ``execute(..., out=)`` fills in place."""
    if live.model is None:
        return {}
    params = live.params()
    with torch.no_grad():
        return {s.key: live_tensor(live, params, s) for s in shard_specs(live, module, plan) if s.key.state != "master"}


def export_state(live: LiveLlama, module: Module, plan: str) -> tuple[LocalState, int]:
    """This rank's shards under ``plan`` (views of the live tensors) and AdamW's step (0 for a
    frozen model, which has no optimizer)."""
    if live.model is None:
        return {}, 0
    steps = {int(s["step"]) for s in live.optimizer.state.values()} if live.optimizer is not None else {0}
    if len(steps) != 1:
        raise ValueError(f"AdamW's parameters are at different steps {sorted(steps)}")
    specs, params = shard_specs(live, module, plan), live.params()
    unnamed = sorted(set(params) - {s.key.tensor for s in specs})
    if unnamed:
        raise ValueError(f"plan @{plan} holds no shard of the live parameters {', '.join(unnamed[:3])} on this rank")
    with torch.no_grad():
        return {s.key: live_tensor(live, params, s) for s in specs}, steps.pop()


def export_states(lives: dict[str, LiveLlama], module: Module, plan: str) -> tuple[LocalState, dict[str, int]]:
    """``export_state`` of every live model of a job (by model-stage): the union of their shards,
    and each model's AdamW step."""
    state: LocalState = {}
    steps = {}
    for ms, live in lives.items():
        mine, steps[ms] = export_state(live, module, plan)
        state.update(mine)
    return state, steps


def load_state(live: LiveLlama, module: Module, plan: str, state: LocalState, step: int) -> None:
    """Write ``state`` (this rank's shards under ``plan``) and ``step`` into the live model and
    optimizer, bit for bit. Raises where a key is missing or ``master`` differs from ``weight``."""
    if live.model is None:
        return
    specs, params = shard_specs(live, module, plan), live.params()
    missing = [str(s.key) for s in specs if s.key not in state]
    if missing:
        raise KeyError(
            f"the state lacks {plural(len(missing), 'shard')} plan @{plan} puts here: {', '.join(missing[:3])}"
        )
    with torch.no_grad():
        for s in specs:
            if s.key.state == "master":
                weight = state[StateKey(s.key.model_stage, "weight", s.key.tensor)]
                if not torch.equal(state[s.key], weight):
                    raise ValueError(f"{s.key}: the fp32 master differs from the weight; the live model holds one")
                continue
            dst = live_tensor(live, params, s)
            if state[s.key].data_ptr() != dst.data_ptr():
                dst.copy_(state[s.key])
        if live.optimizer is not None:
            for p in live.named.values():
                live.optimizer.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)
