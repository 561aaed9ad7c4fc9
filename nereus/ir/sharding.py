"""Derive the EMUs of a model-stage from its layout: who holds which slice of every weight.

Weights follow the model's TP sharding rules (``Model.tp_span``) and the layout's pipeline
layer ranges. One entry per (family, pipeline stage) covers the stage's whole layer range,
since every layer of a stage is sliced the same way.
"""

from __future__ import annotations

from .emu import Emu, Shard, SliceEntry
from .model import Model
from .plan import Layout


def shard_entries(model: Model, layout: Layout, pp: int, tp: int, states=("weight",)) -> list[SliceEntry]:
    """The slices held at pipeline stage ``pp``, tensor rank ``tp``, in inventory order."""
    lo, hi = layout.layers[pp]
    out = []
    for state in states:
        for spec in model.tensors.values():
            if spec.per_layer:
                layers = (lo, hi)
            elif pp in model.stages_holding(spec, layout.pp):
                layers = None
            else:
                continue
            box = model.tp_box(spec, layout.tp, tp)
            if any(hi <= lo for lo, hi in box):
                continue  # a dimension smaller than TP leaves the last ranks with nothing of it
            out.append(SliceEntry(family=spec.family, layers=layers, box=box, state=state))
    return out


def derive_emus(plan_name: str, model: Model, layout: Layout, states=("weight",)) -> list[Emu]:
    """Every EMU (one per DP replica) of ``layout``'s model-stage."""
    per_coord = {(p, t): shard_entries(model, layout, p, t, states) for p in range(layout.pp) for t in range(layout.tp)}
    emus = []
    for d in range(layout.dp):
        shards = [Shard(pp=p, tp=t, gpu=layout.gpu(d, p, t), entries=per_coord[p, t])
                  for p in range(layout.pp) for t in range(layout.tp)]
        emus.append(Emu(plan=plan_name, model_stage=layout.model_stage, replica=d, shards=shards))
    return emus
