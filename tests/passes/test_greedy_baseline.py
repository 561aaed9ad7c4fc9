"""The hand-tuned baseline ``plan-search`` is measured against is the best layout of every
model-stage: no single model-stage can change its TP/PP/DP (within what the frameworks accept,
every model-stage of a stage on all GPUs) for a shorter step under ``estimate``.

The variations are enumerated here by hand, independently of ``greedy_plan``'s own generator:
TP dividing the heads and a multiple or divisor of the KV heads, up to a node; PP dividing the
layers or a power of two; DP filling the GPUs (at most one replica per sample); the frameworks'
defaults otherwise (4 x PP micro-batches, at most what one pipeline flush holds per replica:
a mini-batch when training, the step otherwise); training with or without recomputation, at
ZeRO 0-3 when DP > 1 (the operator's memory knobs).
"""

from __future__ import annotations

import copy

import pytest

from nereus.bench.baselines.greedy_plan import greedy_plan
from nereus.ir import Layout, parse
from nereus.ir.model import even_split
from nereus.passes.cost.estimate import estimate_plan
from nereus.testing.jobs import grpo_7b_8gpu, ppo_8b_16gpu


def variations(m, workload, cluster, ms: str, kind: str) -> list[Layout]:
    model = m.models[ms.rpartition(".")[0]]
    n = cluster.num_gpus  # healthy cluster: every GPU available, TP sizes divide a node
    out = []
    for tp in range(1, cluster.gpus_per_node + 1):
        if model.heads % tp or not (tp % model.kv_heads == 0 or model.kv_heads % tp == 0):
            continue
        for pp in range(1, model.layers + 1):
            if model.layers % pp and pp & (pp - 1):
                continue
            dp = min(n // (tp * pp), workload.samples)
            if dp < 1:
                continue
            flush = (workload.mini_batch or workload.samples) if kind == "train" else workload.samples
            micro = flush // dp // workload.micro_batch
            if pp > 1 and kind != "generate" and micro < 1:
                continue
            layers = [(lo, hi - 1) for lo, hi in (even_split(model.layers, pp, r) for r in range(pp))]
            knobs = [(rc, z) for rc in (False, True) for z in (range(4) if dp > 1 else [0])]
            for recompute, zero in knobs if kind == "train" else [(False, 0)]:
                out.append(
                    Layout(
                        model_stage=ms,
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        layers=layers,
                        mesh=list(range(tp * pp * dp)),
                        micro_batches=min(4 * pp, micro) if pp > 1 and kind != "generate" else 1,
                        zero=zero,
                        recompute=recompute,
                    )
                )
    return out


@pytest.mark.parametrize("job", [grpo_7b_8gpu, ppo_8b_16gpu])
def test_no_single_model_stage_variation_beats_the_baseline(job):
    m = parse(job())
    m.emus.clear()
    workload, cluster = next(iter(m.workloads.values())), next(iter(m.clusters.values()))
    base = greedy_plan(m, workload, cluster)
    assert base is not None and estimate_plan(m, base) == [] and base.step_time > 0
    tried = 0
    for st in workload.stages:
        mss = st.model_stages()
        for ms in mss:
            mine = base.layouts[ms]
            assert mine.mesh[0] == 0  # every model-stage of a stage starts on the same GPUs (colocated)
            options = variations(m, workload, cluster, ms, st.kind)
            assert any(
                (o.tp, o.pp, o.dp, o.micro_batches, o.mesh, o.zero, o.recompute)
                == (mine.tp, mine.pp, mine.dp, mine.micro_batches, mine.mesh, mine.zero, mine.recompute)
                for o in options
            ), (ms, mine.tp, mine.pp, mine.dp)
            for lay in options:
                plan = copy.deepcopy(base)
                plan.layouts[ms] = lay
                if estimate_plan(m, plan):
                    continue  # does not fit beside the others
                tried += 1
                assert base.step_time <= plan.step_time, (ms, lay.tp, lay.pp, lay.dp, plan.step_time, base.step_time)
        if len(mss) > 1:
            assert sorted(mss) in [sorted(c) for c in base.colocate]
    assert tried >= 2 * len(workload.model_stages())
