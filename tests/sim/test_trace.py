"""Traces: the documented JSON-lines format round-trips, bad lines are diagnostics at their line,
and the shipped traces are what their headers say."""

import json

import pytest

from nereus.ir import DiagnosticError
from nereus.sim.generate import SHIPPED, TRACES, length_shares, make_trace
from nereus.sim.trace import read_trace, write_trace


def test_a_generated_trace_round_trips_and_is_deterministic_in_its_seed(tmp_path):
    t = make_trace("t", steps=300, gpus=256, seed=3)
    write_trace(t, tmp_path / "t.jsonl")
    back = read_trace(tmp_path / "t.jsonl")
    assert back.steps == t.steps and (back.gpus, back.job, back.sources) == (t.gpus, t.job, t.sources)
    assert make_trace("t", steps=300, gpus=256, seed=3).steps == t.steps
    assert make_trace("t", steps=300, gpus=256, seed=4).steps != t.steps
    # unchanged steps are bare: the file stays short
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert sum(1 for line in lines[1:] if json.loads(line).keys() == {"step"}) > 200


@pytest.mark.parametrize("mean,cap", [(1500, 8192), (6000, 16384), (9900, 24576)])
def test_length_shares_have_the_asked_mean_under_the_cap(mean, cap):
    d = length_shares(mean, cap)
    assert list(d) == sorted(d) and d[-1] <= cap and len(d) == 8
    assert sum(d) / 8 == pytest.approx(mean, rel=0.01)
    assert d[-1] > 2.5 * d[3]  # a long tail: the longest eighth is far above the median


BAD = [
    ('{"step": 1, "response_len_dist": [5]}', "step 1 out of order: expected 0"),
    ('{"step": 0, "response_len_dist": [9, 5]}', "response_len_dist must be positive integers in increasing order"),
    (
        '{"step": 0, "response_len_dist": [5], "unavailable": [[60, 70]]}',
        "unavailable range [60, 70] is outside GPUs 0..63",
    ),
    ('{"step": 0, "response_len_dist": [5], "gpu": 3}', "unknown keys ['gpu']"),
    ('{"step": 0, "response_len_dist": [5]', "not JSON"),
    ("[1, 2]", "a trace line is a JSON object"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_a_malformed_line_is_a_diagnostic_at_its_line(tmp_path, line, message):
    head = json.dumps({"trace": "bad", "job": "ppo_8b_16gpu", "gpus": 64})
    path = tmp_path / "bad.jsonl"
    path.write_text(head + "\n" + line + "\n")
    with pytest.raises(DiagnosticError) as e:
        read_trace(path)
    d = e.value.diagnostics[0]
    assert message in d.message and d.loc.line == 2 and d.loc.file == str(path)


def test_the_shipped_traces_are_what_their_headers_say():
    for name in SHIPPED:
        t = read_trace(TRACES / f"{name}.jsonl")
        assert len(t.steps) == 1000 and t.gpus == 1024 and t.sources
        assert t.job == SHIPPED[name].get("job", "ppo_70b_1024gpu")
        means = [s.response_len_mean for s in t.steps]
        counts = [len(t.available(i)) for i in range(len(t.steps))]
        if SHIPPED[name]["lengths"]:
            assert means[-1] > 5 * means[0]  # R1-Zero-like growth, 1.5k -> ~10k
            assert max(max(s.response_len_dist) for s in t.steps) > 16384  # the cap rose to 24k
        else:
            assert len(set(means)) == 1
        if SHIPPED[name]["churn"]:
            assert counts[0] == 512 and max(counts) == 1024  # reaching 1,024 GPUs
            assert any(s.leaving for s in t.steps)  # preemptions with notice
        else:
            assert set(counts) == {1024}
