"""A mixture of experts through the optimizer passes: its experts are families like any other, so
plan-search costs and places it, and plan-transition moves every expert between two layouts
with the fewest bytes (checked on numpy arrays by the reference executor)."""

from __future__ import annotations

import nereus
from nereus.runtime.reference_executor import simulate

MOE_JOB = """
cluster @c {
  nodes = 1
  gpus_per_node = 8
  gpu_memory = 80GiB
  peak_flops = 989TFLOPs
  hbm_bandwidth = 3.35TB/s
  intra_node = link(bandwidth = 450GB/s, latency = 2us)
  inter_node = link(bandwidth = 50GB/s, latency = 5us)
}

model @actor {
  layers = 4
  hidden = 64
  heads = 4
  kv_heads = 2
  ffn = 128
  vocab = 128
  qk_norm = true
  experts = 4
  experts_per_token = 2
  expert_ffn = 32
  trained = true
}

workload @w {
  algorithm = grpo
  roles = [@actor]
  global_batch = 16
  group_size = 4
  prompt_len_mean = 64
  prompt_len_max = 128
  response_len_mean = 64
  response_len_max = 128
  micro_batch = 2
  stage generate { kind = generate, models = [@actor] }
  stage train { kind = train, models = [@actor] }
}

plan @a {
  workload = @w
  cluster = @c
  layout actor.generate { tp = 2, pp = 1, dp = 4, layers = [0..3], mesh = [0..7] }
  layout actor.train { tp = 2, pp = 1, dp = 4, layers = [0..3], mesh = [0..7] }
}

plan @b {
  workload = @w
  cluster = @c
  layout actor.generate { tp = 1, pp = 1, dp = 8, layers = [0..3], mesh = [0..7] }
  layout actor.train { tp = 4, pp = 2, dp = 1, layers = [0..1, 2..3], mesh = [7, 6, 5, 4, 3, 2, 1, 0], zero = 0 }
}
"""


def test_every_expert_moves_between_layouts_with_lower_bound_bytes():
    m = nereus.verify(nereus.parse(MOE_JOB))
    nereus.run_pipeline(m, "plan-transition{to=@b},schedule-transfers")
    t = m.transitions["a_to_b"]
    result = simulate(m, t)
    assert result.mismatches == []
    assert t.bytes_moved == t.lower_bound == result.received_bytes > 0
    moved = {op.family for op in t.ops if op.kind in ("send", "broadcast")}
    assert {f"mlp.experts.{e}.{w}_proj.weight" for e in range(4) for w in ("gate", "up", "down")} <= moved
    assert nereus.parse(nereus.print_ir(m)) == m


def test_plan_search_places_a_mixture_of_experts():
    m = nereus.verify(nereus.parse(MOE_JOB))
    before = set(m.plans)
    nereus.run_pipeline(m, "plan-search")
    (new,) = set(m.plans) - before
    nereus.verify(m)
    assert m.plans[new].step_time > 0
