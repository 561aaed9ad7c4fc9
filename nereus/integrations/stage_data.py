"""Data between the model-stages of a live job whose layouts differ.

Each model-stage runs on its own layout: the actor's DP replica ``d`` of 2 generates and trains
rows ``[d n/2, (d+1) n/2)``, while the reference under DP 4 scores quarters, and the critic under
DP 1 the whole batch. What one stage produces for another (sequences, log-probabilities,
values) therefore crosses layouts, as ReaL's data transfers between its function calls do.

``live`` is a live model (``hf_llama.LiveLlama``) or the generation engines
(``engine_stage.EngineStage``): anything with a ``layout`` and this rank's ``coordinate`` in it.
``rows(live, n)`` is the slice of a global batch of ``n`` rows that this rank's replica takes
(None off the layout); ``assemble(live, part, shape, dtype, group)`` puts every replica's slice together
on every rank of ``group``: one rank per replica (TP rank 0 of PP stage 0) writes its rows into a
zero tensor and one ``all_reduce`` sums them. Each element has one writer, so the sum is exact:
the result is bit-identical to the replicas' outputs, whatever the layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .hf_llama import LiveLlama


def rows(live: LiveLlama, n: int) -> slice | None:
    """The rows of a global batch of ``n`` that this rank's replica takes; None off the layout."""
    if live.coordinate is None:
        return None
    dp, d = live.layout.dp, live.coordinate[0]
    if n % dp:
        raise ValueError(f"{live.layout.model_stage}: a batch of {n} rows does not split over DP {dp}")
    return slice(d * n // dp, (d + 1) * n // dp)


def assemble(
    live: LiveLlama, part: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, group=None
) -> torch.Tensor:
    """The global tensor of ``shape`` (``[n, ...]``) on every rank of ``group`` (None: the default
    group) from each replica's ``part`` (its ``rows``; ignored off the layout). Every rank of
    ``group`` calls it, on the layout or not."""
    out = torch.zeros(shape, dtype=dtype)
    mine = rows(live, shape[0])
    if mine is not None and live.coordinate[1] == 0 and live.coordinate[2] == 0:
        out[mine] = part
    dist.all_reduce(out, group=group)
    return out
