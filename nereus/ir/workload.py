"""The RL workload: roles, stages in order, batch and sequence sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .attributes import AttrSpec
from .diagnostics import NOWHERE, Loc

STAGE_KINDS = ("generate", "infer", "train")

WORKLOAD_ATTRS = [
    AttrSpec(
        "algorithm",
        "choice",
        choices=("ppo", "grpo", "sft"),
        doc="ppo (needs a critic), grpo (groups of at least 2), sft (training on given samples, no generation needed)",
    ),
    AttrSpec("roles", "symbols", doc="the models of the job, e.g. [@actor, @critic, @ref, @reward]"),
    AttrSpec("global_batch", "posint", doc="prompts per step"),
    AttrSpec("group_size", "posint", default=1, doc="responses per prompt (GRPO's group)"),
    AttrSpec("prompt_len_mean", "posint"),
    AttrSpec("prompt_len_max", "posint"),
    AttrSpec("response_len_mean", "posint"),
    AttrSpec("response_len_max", "posint"),
    AttrSpec(
        "response_len_dist",
        "ints",
        default=[],
        doc="response lengths of equal shares of the responses, shortest first (8 values: each an eighth); "
        "their mean is response_len_mean. Generation is then costed as continuous batching drains them",
    ),
    AttrSpec("ppo_epochs", "posint", default=1),
    AttrSpec("mini_batch", "posint", default=None, doc="samples per optimizer step; default: one per step"),
    AttrSpec("micro_batch", "posint", doc="samples per forward/backward per replica"),
    AttrSpec(
        "micro_batch_tokens",
        "posint",
        default=None,
        doc="dynamic batching: micro-batches are packed up to this many tokens per replica instead of "
        "micro_batch samples (verl use_dynamic_bsz with ppo_max_token_len_per_gpu, OpenRLHF packing); "
        "activations are sized for it, or for the longest sequence when that is longer",
    ),
    AttrSpec("steps", "posint", default=None, doc="total steps of the run"),
]

STAGE_ATTRS = [
    AttrSpec("kind", "choice", choices=STAGE_KINDS),
    AttrSpec("models", "symbols", doc="the roles that run in this stage"),
]


@dataclass(kw_only=True)
class Stage:
    name: str
    kind: str
    models: list[str]
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    def model_stages(self) -> list[str]:
        return [f"{m}.{self.name}" for m in self.models]


@dataclass(kw_only=True)
class Workload:
    name: str
    algorithm: str
    roles: list[str]
    global_batch: int
    prompt_len_mean: int
    prompt_len_max: int
    response_len_mean: int
    response_len_max: int
    micro_batch: int
    response_len_dist: list[int] = field(default_factory=list)
    group_size: int = 1
    ppo_epochs: int = 1
    mini_batch: int | None = None
    micro_batch_tokens: int | None = None
    steps: int | None = None
    stages: list[Stage] = field(default_factory=list)
    loc: Loc = field(default=NOWHERE, compare=False, repr=False)
    locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    comments: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def samples(self) -> int:
        """Sequences per step: prompts x group size."""
        return self.global_batch * self.group_size

    def longest_micro_batch_tokens(self) -> int:
        """Tokens of the longest micro-batch any replica can see, which its activations must fit.

        With a token budget (``micro_batch_tokens``) a micro-batch holds up to the budget, or one
        sequence longer than it. Otherwise it holds ``micro_batch`` samples, and the worst one holds
        the longest of the step: the longest response (``response_len_max``), then responses from
        the top of ``response_len_dist`` (each value an eighth of the responses), each with a
        prompt of ``prompt_len_max``. Without a distribution, every one is as long as the longest
        (what padding to the longest gives, and the bound packing cannot beat). Time is costed at
        the mean length; only memory needs this bound.
        """
        longest = self.prompt_len_max + self.response_len_max
        if self.micro_batch_tokens is not None:
            return max(self.micro_batch_tokens, longest)
        k = max(1, min(self.micro_batch, self.samples))
        if not self.response_len_dist:
            return k * longest
        share = math.ceil(self.samples / len(self.response_len_dist))  # responses per value, rounded up
        tokens, left = longest, k - 1
        for i, length in enumerate(reversed(self.response_len_dist)):
            take = min(left, share - 1 if i == 0 else share)  # the longest response is one of the top share
            tokens += take * (self.prompt_len_max + length)
            left -= take
        return tokens

    def model_stages(self) -> list[str]:
        """Every model-stage in execution order, e.g. ``actor.generate``."""
        return [ms for s in self.stages for ms in s.model_stages()]

    def stage_of(self, model_stage: str) -> Stage | None:
        model, _, stage = model_stage.rpartition(".")
        for s in self.stages:
            if s.name == stage and model in s.models:
                return s
        return None
