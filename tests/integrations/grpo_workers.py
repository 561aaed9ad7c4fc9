"""What every rank runs in the RL examples' tests: ``examples/grpo_tiny.py``'s (or ``ppo_tiny.py``'s) ``main`` with an
adapter that checks each move against the full state gathered and re-sliced."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from nereus.backend.shards import plan_layout
from nereus.integrations.llama_adapter import LlamaAdapter
from nereus.integrations.llama_state import export_state
from nereus.runtime.execute import Fault
from nereus.runtime.state import cut

from .workers import gather_full

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class CheckedAdapter(LlamaAdapter):
    """``LlamaAdapter`` that, around each move, gathers plan A's full state (every rank: the
    default group is whole then) and checks that this rank's plan B state is its slices, bit for
    bit, with AdamW's step carried over."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[dict] = []

    def move(self, module, source, target, **kwargs) -> None:
        rank = torch.distributed.get_rank()
        state_a, step_a = export_state(self.live, module, source)
        full = gather_full(state_a, plan_layout(module, source).get(rank, []))
        try:
            super().move(module, source, target, **kwargs)
        except Exception as e:  # a rollback: plan A's state must be as it was
            after, step = export_state(self.live, module, source)
            self.checks.append(
                {
                    "source": source,
                    "target": target,
                    "failed": type(e).__name__,
                    "step_a": step_a,
                    "intact": step == step_a
                    and all(
                        torch.equal(after[s.key], cut(full[s.key], s.box))
                        for s in plan_layout(module, source).get(rank, [])
                    ),
                }
            )
            raise
        ms = self.live.layout.model_stage
        specs = [s for s in plan_layout(module, target).get(rank, []) if s.key.model_stage == ms]
        state_b, step_b = export_state(self.live, module, target)
        self.checks.append(
            {
                "source": source,
                "target": target,
                "in_b": self.live.model is not None,
                "keys": len(specs),
                "same_keys": set(state_b) == {s.key for s in specs},
                "exact": all(torch.equal(state_b[s.key], cut(full[s.key], s.box)) for s in specs),
                "step_a": step_a,
                "step_b": step_b,
            }
        )


def run(rank: int, world: int, argv: list[str], example: str = "grpo_tiny", fault_rank: int | None = None) -> dict:
    """``examples/<example>.py``'s ``main`` (``grpo_tiny`` or ``ppo_tiny``) with ``CheckedAdapter``;
    ``fault_rank``: that rank raises inside every transition (``Fault("raise")``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(example)
    if fault_rank is None:
        return module.main(argv, adapter_cls=CheckedAdapter)
    return module.main(argv, adapter_cls=CheckedAdapter, faults=(Fault("raise", rank=fault_rank),))
