"""What a running job measures each step, as the decision core reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

SHARES = 8  # equal shares a measured length distribution is summarised by


def equal_shares(lengths, shares: int = SHARES) -> tuple[int, ...]:
    """The mean length of each of ``shares`` equal shares of the sorted ``lengths``."""
    xs = sorted(int(x) for x in lengths)
    n = len(xs)
    out = []
    for i in range(shares):
        part = xs[i * n // shares : (i + 1) * n // shares] or xs[min(i * n // shares, n - 1) :][:1]
        out.append(max(1, round(sum(part) / len(part))))
    return tuple(out)


@dataclass(frozen=True)
class StepRecord:
    """One training step as measured.

    ``seconds`` and ``memory``: per model-stage (``actor.train``...), wall time of the stage on
    its slowest rank and peak device memory on its fullest GPU (bytes). ``response_lengths``:
    the lengths (tokens) of the responses generated this step; or, where a loop gathers only a
    summary (the Controller does: a fixed-size tensor per rank), ``responses = (count, total
    tokens, longest)``. The core reads the summary; it is derived from the lengths when they
    are given. ``length_shares`` (optional): the lengths of equal shares of the responses, as a
    workload's ``response_len_dist``; given, the core re-plans for that distribution (derived from
    ``response_lengths`` when those are given). ``gpus``: the GPUs the job may
    use now; ``leaving``: GPUs announced to leave (they still hold state and can send it).
    """

    step: int
    seconds: dict[str, float]
    memory: dict[str, int] = field(default_factory=dict)
    response_lengths: tuple[int, ...] = ()
    gpus: tuple[int, ...] | None = None  # None: unchanged
    leaving: tuple[int, ...] = ()
    responses: tuple[int, int, int] | None = None  # (count, total tokens, longest)
    length_shares: tuple[int, ...] = ()  # optional: the lengths of equal shares of the responses (sorted)

    def __post_init__(self):
        if self.responses is None:
            n = self.response_lengths
            object.__setattr__(self, "responses", (len(n), sum(n), max(n, default=0)))
            if n and not self.length_shares:
                object.__setattr__(self, "length_shares", equal_shares(n))
        elif self.response_lengths:
            raise ValueError("give response_lengths or responses, not both")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        for ms, s in self.seconds.items():
            if not s > 0:
                raise ValueError(f"seconds of {ms} must be positive, got {s}")

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "seconds": dict(self.seconds),
            "memory": dict(self.memory),
            "responses": list(self.responses),
            "length_shares": list(self.length_shares),
            "gpus": None if self.gpus is None else list(self.gpus),
            "leaving": list(self.leaving),
        }
