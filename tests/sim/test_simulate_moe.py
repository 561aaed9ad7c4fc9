"""The simulator on a mixture of experts: GRPO on Qwen3-30B-A3B (128 experts, top 8) on 2 nodes
of 8 H100s, under the event truth, on a trace whose GPUs change. Every policy plans with expert
parallelism on the table and runs every step; Nereus moves the experts' state when GPUs leave.
(The 1,024-GPU run of Qwen3-235B-A22B is ``nereus simulate nereus/sim/traces/moe_combined.jsonl``,
in docs/RESULTS.md.)"""

import pytest

import nereus
from nereus.ir.presets import preset_attrs
from nereus.sim.generate import length_shares
from nereus.sim.simulate import simulate
from nereus.sim.trace import Trace, TraceStep
from nereus.testing.jobs import H100

STEPS = 16
JOB = f"""\
cluster @h100x16 {{
  nodes = 2
  gpus_per_node = 8
{H100}
}}
model @actor {{ {preset_attrs("qwen3-30b-a3b")}, trained = true }}
model @ref {{ {preset_attrs("qwen3-30b-a3b")} }}
workload @grpo {{
  algorithm = grpo
  roles = [@actor, @ref]
  global_batch = 64
  group_size = 8
  prompt_len_mean = 512
  prompt_len_max = 1024
  response_len_mean = 1024
  response_len_max = 4096
  mini_batch = 256
  micro_batch = 2
  steps = 100
  stage generate {{ kind = generate, models = [@actor] }}
  stage infer {{ kind = infer, models = [@actor, @ref] }}
  stage train {{ kind = train, models = [@actor] }}
}}
"""


def _trace() -> Trace:
    """16 GPUs; GPUs 12-15 announced to leave at step 5 and gone from 6 to 11, back from 12."""
    steps = []
    for i in range(STEPS):
        down = frozenset(range(12, 16)) if 6 <= i < 12 else frozenset()
        leaving = frozenset(range(12, 16)) if i == 5 else frozenset()
        steps.append(TraceStep(i, length_shares(1000 + 50 * i, 4096), down, leaving))
    return Trace("moe", "grpo_moe_16gpu", 16, steps)


@pytest.fixture(scope="module")
def result():
    return simulate(nereus.parse(JOB, "moe.nir"), _trace(), progress=False)


def test_every_policy_runs_a_mixture_of_experts_and_nereus_moves_it_without_a_failed_step(result):
    for name, run in result["runs"].items():
        assert len(run.latency) == STEPS, name
    for name in ("nereus", "oracle"):  # they plan with what they measured: no step fails
        run = result["runs"][name]
        assert run.failures == 0 and all(x > 0 for x in run.step), name
    assert len(result["runs"]["nereus"].moves) >= 2  # a quarter of the GPUs left, and came back
