"""``load_behind`` and ``WeightStream``, the hand-off between a push on its thread and a loader
that takes each wave as it lands (vLLM's ``reload_weights`` in ``test_vllm_engine.py``; here a
loader that keeps what it takes, so that every ending of a push is seen alone): what the loader
takes, when it starts, and which error the caller gets."""

from __future__ import annotations

import time

import pytest
import torch

from nereus.integrations.weight_push import WeightStream, load_behind


class Keeper:
    """A loader: takes the stream's pairs one by one; ``stop_after`` pairs, it fails. Returns
    what an engine's ``load`` returns in its place (its seconds): here, the pairs it took."""

    def __init__(self, stop_after: int | None = None):
        self.calls, self.took, self.stop_after = 0, [], stop_after

    def load(self, stream: WeightStream) -> float:
        self.calls += 1
        for name, _ in stream:
            if self.stop_after is not None and len(self.took) == self.stop_after:
                raise ValueError("the loader stopped")
            self.took.append(name)
        return float(len(self.took))


def waves(n: int, fail_at: int | None = None):
    """A push of ``n`` waves of two tensors each, failing before wave ``fail_at``."""

    def push(put):
        for w in range(n):
            if w == fail_at:
                raise RuntimeError(f"the push failed before wave {w}")
            put([(f"w{w}.a", torch.full((2,), float(w))), (f"w{w}.b", torch.zeros(1))])
        return "committed"

    return push


def test_every_wave_reaches_the_loader_in_order_and_the_push_result_returns():
    engine, stream = Keeper(), WeightStream()
    assert load_behind(engine, waves(3), stream) == "committed"
    assert engine.took == ["w0.a", "w0.b", "w1.a", "w1.b", "w2.a", "w2.b"]
    assert stream.complete and stream.taken == 6 and engine.calls == 1
    assert stream.load_s == 6.0  # what the loader's load returned, kept for ``PushStats.load_s``


def test_a_push_that_fails_before_its_first_wave_never_starts_the_load():
    engine, stream = Keeper(), WeightStream()
    with pytest.raises(RuntimeError, match="before wave 0"):
        load_behind(engine, waves(3, fail_at=0), stream)
    assert engine.calls == 0 and stream.taken == 0 and not stream.complete and stream.load_s == 0.0


def test_a_push_that_fails_midway_leaves_what_the_loader_took_and_raises():
    engine, stream = Keeper(), WeightStream()
    with pytest.raises(RuntimeError, match="before wave 2"):
        load_behind(engine, waves(3, fail_at=2), stream)
    assert engine.took == ["w0.a", "w0.b", "w1.a", "w1.b"] and not stream.complete


def test_a_loader_that_fails_fails_the_push_at_its_next_wave_and_both_errors_are_kept():
    engine, stream = Keeper(stop_after=1), WeightStream()

    def push(put):  # its second wave comes once the loader has given up (bounded wait)
        put([("w0.a", torch.zeros(1)), ("w0.b", torch.zeros(1))])
        deadline = time.monotonic() + 30
        while stream.abandoned is None and time.monotonic() < deadline:
            time.sleep(0.001)
        put([("w1.a", torch.zeros(1))])
        return "committed"

    with pytest.raises(RuntimeError, match="the engine stopped loading") as e:
        load_behind(engine, push, stream)
    assert isinstance(e.value.__cause__, ValueError) and engine.took == ["w0.a"]
    assert stream.abandoned is not None and not stream.complete


def test_a_push_with_nothing_for_this_engine_commits_without_a_load():
    engine, stream = Keeper(), WeightStream()
    assert load_behind(engine, lambda put: "committed", stream) == "committed"
    assert engine.calls == 0 and stream.complete
