"""``nereus bench ep``: a mixture of experts moved between expert-parallel layouts by real processes.

The cases of ``nereus.testing.cases.EP_CASES`` (8 experts, top 2): EP 4 -> EP 2 of training state
(each GPU gains the experts its new EP rank holds), and training EP 4 -> generation engines of TP 2
with EP 2 over their ranks (weights only), on 4 and 8 gloo processes, run as ``nereus bench reshard``
runs its cases (``reshard_bench``: the same methods, timing, CPU seconds and bit-exact checks).
The peers that matter here: ``allgather`` (all-gather every expert, then slice: verl's resharding)
and ``holder-bcast`` (each expert broadcast whole by its owner: slime's and NeMo-RL's expert sync).
"""

from __future__ import annotations

from ..testing.cases import EP_CASES
from . import reshard_bench


def run(quick: bool = False, json_output: bool = False) -> dict:
    return reshard_bench.run(quick=quick, json_output=json_output, cases=list(EP_CASES))
