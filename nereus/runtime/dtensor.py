"""DTensor views of a plan's shards: the layout's DeviceMesh, and placements where DTensor can say the layout.

``device_mesh(layout)`` is a ``DeviceMesh`` with dims ``("dp", "pp", "tp")`` over the layout's
GPUs (rank == GPU id; ``layout.mesh`` lists them in (dp, pp, tp) order, tp fastest). Pipeline
parallelism is not a placement: a tensor lives on the ``("dp", "tp")`` sub-mesh of its pipeline
stage, and ``placements`` are over that sub-mesh:

- tp: ``Shard(0)`` for column and vocab tensors, ``Shard(1)`` for row tensors, ``Replicate()``
  for replicated ones (norms);
- dp: ``Replicate()``, or ``Shard(0)`` where ZeRO splits the state over DP (optimizer state from
  ``zero = 1``, weights from ``zero = 3``).

Whether DTensor expresses the layout is checked, not assumed: for every (dp, tp) coordinate,
the box DTensor gives (``Shard.local_shard_size_and_offset`` over the mesh dims left to right:
``torch.chunk``'s rule) must be the box ``ir.sharding`` gives (what ``plan_layout`` holds).
Where they differ, ``placements`` returns ``None`` and the reason, which is one of:

- uneven splits: ``tensor_split`` (ours) gives the first ``n % t`` ranks one row more,
  ``torch.chunk`` gives ``ceil(n / t)`` rows to all but the last ranks (equal only when ``n % t``
  is 0 or ``t - 1``);
- K/V heads replicated on ``tp / kv_heads`` consecutive TP ranks (``tp > kv_heads``): a block of
  ranks sharing one shard is not a placement of the tp dimension;
- ZeRO on a tensor TP splits along dim 0: ZeRO splits each TP shard over DP (TP first), DTensor
  splits over DP first (FSDP2 uses the private ``_StridedShard`` for this);
- a dimension smaller than TP or DP: some ranks hold no shard at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..ir.model import KV_FAMILIES, Model
from ..ir.plan import Layout
from ..ir.sharding import dp_sharded, shard_entries
from .state import ShardSpec

MESH_DIMS = ("dp", "pp", "tp")


class Placements(NamedTuple):
    placements: tuple[Placement, Placement] | None  # over the ("dp", "tp") sub-mesh; None: inexpressible
    reason: str  # why not, when None


def device_mesh(layout: Layout, device_type: str = "cpu") -> DeviceMesh:
    """The layout's mesh, dims ("dp", "pp", "tp").

    Creating it creates process groups: every rank of the default group calls it, including
    ranks outside the layout (for them ``get_coordinate()`` is None).
    """
    mesh = torch.tensor(layout.mesh, dtype=torch.int).view(layout.replicas, layout.pp, layout.tp)
    return DeviceMesh(device_type, mesh, mesh_dim_names=MESH_DIMS)


def family_and_layer(tensor: str) -> tuple[str, int | None]:
    """``layers.3.mlp.up_proj.weight`` -> (``mlp.up_proj.weight``, 3); ``norm.weight`` -> (``norm.weight``, None)."""
    if tensor.startswith("layers."):
        _, layer, family = tensor.split(".", 2)
        return family, int(layer)
    return tensor, None


def placements(model: Model, layout: Layout, family: str, state: str = "weight") -> Placements:
    """DTensor placements of ``family``'s ``state`` under ``layout``, or None and the reason."""
    spec = model.tensors[family]
    pp = 0 if spec.per_layer else model.stages_holding(spec, layout.pp)[0]
    zero = dp_sharded(state, layout.zero) and layout.replicas > 1
    cand = (
        Shard(0) if zero else Replicate(),
        Shard(spec.tp_dim) if spec.tp_dim is not None and layout.tp > 1 else Replicate(),
    )
    for d in range(layout.replicas):
        for t in range(layout.tp):
            ours = [e.box for e in shard_entries(model, layout, pp, t, (state,), d) if e.family == family]
            if not ours:
                return Placements(
                    None,
                    f"{family}: a dimension smaller than TP {layout.tp} or DP {layout.replicas} "
                    "leaves some ranks without a shard",
                )
            if tuple(ours[0]) != dtensor_box(spec.shape, cand, (d, t), (layout.replicas, layout.tp)):
                return Placements(None, _reason(model, layout, family, zero))
    return Placements(cand, "")


def dtensor_box(shape, placements, coordinate, mesh_shape) -> tuple[tuple[int, int], ...]:
    """The box of ``shape`` DTensor gives the rank at ``coordinate`` (Shards applied in mesh-dim order)."""
    box = [[0, n] for n in shape]
    for p, c, size in zip(placements, coordinate, mesh_shape):
        if isinstance(p, Shard):
            lo, hi = box[p.dim]
            length, offset = Shard.local_shard_size_and_offset(hi - lo, size, c)
            box[p.dim] = [lo + offset, lo + offset + length]
    return tuple((lo, hi) for lo, hi in box)


def _reason(model: Model, layout: Layout, family: str, zero: bool) -> str:
    spec = model.tensors[family]
    if family in KV_FAMILIES and layout.tp > model.kv_heads:
        return (
            f"{family}: TP {layout.tp} > {model.kv_heads} K/V heads replicates each head on "
            f"{layout.tp // model.kv_heads} TP ranks, not a placement of the tp dimension"
        )
    if zero and spec.tp_dim == 0 and layout.tp > 1:
        return (
            f"{family}: ZeRO splits each TP shard along dim 0 over DP (TP first); DTensor splits "
            "over DP first (needs the private _StridedShard)"
        )
    return (
        f"{family}: the uneven split of {spec.shape} over TP {layout.tp} x DP {layout.replicas} "
        "(tensor_split's rule) is not DTensor's torch.chunk rule"
    )


def to_dtensor(local: torch.Tensor, spec: ShardSpec, model: Model, layout: Layout, mesh: DeviceMesh) -> DTensor:
    """This rank's shard ``local`` (of ``spec``) as a DTensor on its pipeline stage's sub-mesh.

    ``mesh`` is ``device_mesh(layout)``. Raises ValueError with the reason where DTensor cannot
    express the layout, or where ``spec`` is not what this rank holds under ``layout``.
    """
    family, layer = family_and_layer(spec.key.tensor)
    pl = placements(model, layout, family, spec.key.state)
    if pl.placements is None:
        raise ValueError(pl.reason)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not in the layout of {layout.model_stage}")
    d, p, t = coord
    lo, hi = layout.layers[p]
    tspec = model.tensors[family]
    on_stage = lo <= layer <= hi if layer is not None else p in model.stages_holding(tspec, layout.pp)
    box = dtensor_box(spec.shape, pl.placements, (d, t), (layout.replicas, layout.tp))
    if not on_stage or box != tuple(spec.box):
        raise ValueError(f"{spec.key}: box {spec.box} is not what rank {coord} holds under the layout ({box})")
    stride = torch.empty(spec.shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh["dp", "tp"], pl.placements, run_check=False, shape=torch.Size(spec.shape), stride=stride
    )
