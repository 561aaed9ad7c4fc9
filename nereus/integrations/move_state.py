"""``nereus.reshard``: move one model's sharded state from one layout to another, nothing else.

For users who only need to move state (checkpoint conversion, a new TP for evaluation, an
elastic restart): a model's shape and two layouts in, this rank's shards under the new layout
out. No cluster, workload, batch size or sequence length: the IR module the passes need is
built here with nominal figures that only size the cost model, which a pure reshard does not
use. The guarantees are ``execute``'s: every destination shard bit-exact, checksums on every
message, the same program on every rank, and on any failure ``TransitionError`` on every
surviving rank with the caller's ``state`` untouched.

Run it on every rank of an initialised default process group (rank r = GPU r of both
layouts' meshes). Shards are keyed by tensor name as the IR names them
(``layers.0.self_attn.q_proj.weight``, ``embed_tokens.weight``, ``lm_head.weight``); a trained
model's optimizer state is keyed ``"<state>:<tensor>"`` (``master``, ``exp_avg``,
``exp_avg_sq``; fp32). ``nereus.reshard_shards(model, layout, rank)`` lists what a rank holds.
A layout is a dict with ``tp``, ``pp``, ``dp``, ``cp`` (default 1), ``zero`` (default 0) and
``mesh`` (default GPUs 0..n-1 in (dp, cp, pp, tp) order, tp fastest); layers split evenly over
``pp``. Planning and lowering run once per (model, layouts, world) and are cached.
"""

from __future__ import annotations

from dataclasses import fields
from functools import lru_cache

import torch
import torch.distributed as dist

from ..backend.program import Program
from ..backend.shards import ShardSpec, StateKey
from ..ir import Layout, Model
from ..ir.diagnostics import plural
from ..ir.model import even_split
from ..runtime.execute import execute
from .job import training_job
from .move import plan_move

LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "zero", "mesh")


def _model(model: Model | dict) -> Model:
    if isinstance(model, Model):
        return model
    fields = dict(model)
    fields.setdefault("name", "model")
    return Model(**fields)


def _layout(model: Model, spec: Layout | dict, kind: str) -> Layout:
    if isinstance(spec, Layout):
        return spec
    unknown = set(spec) - set(LAYOUT_KEYS)
    if unknown:
        raise ValueError(f"unknown layout keys {sorted(unknown)}; a layout has {', '.join(LAYOUT_KEYS)}")
    tp, pp, dp, cp = (int(spec.get(k, 1)) for k in ("tp", "pp", "dp", "cp"))
    ranges = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
    mesh = list(spec.get("mesh", range(tp * pp * dp * cp)))
    return Layout(
        model_stage=f"{model.name}.{kind}",
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        layers=ranges,
        mesh=mesh,
        zero=int(spec.get("zero", 0)),
        micro_batches=pp,
    )


def _frozen(spec) -> tuple:
    return (
        tuple(sorted((k, tuple(v) if isinstance(v, (list, range)) else v) for k, v in spec.items()))
        if isinstance(spec, dict)
        else (id(spec),)
    )


def _name(key: StateKey) -> str:
    return key.tensor if key.state == "weight" else f"{key.state}:{key.tensor}"


def _model_key(model: Model) -> tuple:
    return tuple((f.name, getattr(model, f.name)) for f in fields(Model) if f.compare)


@lru_cache(maxsize=32)
def _program(model_key: tuple, src: tuple, dst: tuple, world: int, broadcast: str = "auto") -> Program:
    model = Model(**dict(model_key))
    kind = "train" if model.trained else "infer"
    layouts = {
        name: _layout(model, dict((k, list(v) if isinstance(v, tuple) else v) for k, v in spec), kind)
        for name, spec in (("a", src), ("b", dst))
    }
    m = training_job(model, layouts, world)
    return plan_move(m, "a", "b", "t", world, broadcast=broadcast)


def program(model: Model | dict, src: dict, dst: dict, world: int, broadcast: str = "auto") -> Program:
    """The lowered program of the reshard (planned once per arguments; every rank gets the same)."""
    if not all(isinstance(x, dict) for x in (src, dst)):
        raise TypeError("layouts are dicts of tp, pp, dp, cp, zero and mesh")
    return _program(_model_key(_model(model)), _frozen(src), _frozen(dst), world, broadcast)


def reshard_shards(model: Model | dict, layout: dict, rank: int, world: int | None = None) -> dict[str, ShardSpec]:
    """What ``rank`` holds under ``layout``: name -> ``ShardSpec`` (its box in the full tensor, dtype).
    ``world``: the number of ranks; needed outside an initialised process group, whose size it is by default."""
    if world is None:
        if not dist.is_initialized():
            raise ValueError(
                "reshard_shards needs world= outside an initialised process group: "
                f"reshard_shards(model, layout, {rank}, world=N) for a job of N ranks"
            )
        world = dist.get_world_size()
    prog = program(model, layout, layout, world)
    return {_name(s.key): s for s in prog.src.get(rank, [])}


def reshard(
    state: dict[str, torch.Tensor],
    model: Model | dict,
    src: dict,
    dst: dict,
    *,
    timeout: float = 60.0,
    device: torch.device | str | None = None,
    out: dict[str, torch.Tensor] | None = None,
    group=None,
) -> dict[str, torch.Tensor]:
    """This rank's shards under ``dst`` from its shards under ``src`` (see the module docstring).
    ``out``: existing buffers to fill in place for some destination shards. ``group``: the process
    group the layouts' ranks are ranks of (default: the default group; a group of some ranks runs
    the move alone, its broadcasts as chains of point-to-point messages, no subgroups made)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prog = program(model, src, dst, world, "auto" if group is None else "chain")
    keys = {_name(s.key): s.key for spec in (prog.src, prog.dst) for s in spec.get(rank, [])}
    want = {_name(s.key) for s in prog.src.get(rank, [])}
    missing, extra = want - set(state), set(state) - want
    if missing or extra:
        raise ValueError(
            f"rank {rank}: the state under the source layout is {plural(len(want), 'shard')}; "
            + (f"missing {sorted(missing)[:3]}" if missing else "")
            + (f" unexpected {sorted(extra)[:3]}" if extra else "")
        )
    new = execute(
        prog,
        {keys[k]: t for k, t in state.items()},
        device=device,
        timeout=timeout,
        out={keys[k]: t for k, t in (out or {}).items()},
        group=group,
    )
    return {_name(k): t for k, t in new.items()}
