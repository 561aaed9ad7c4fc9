"""verl's checkpoint-engine layer moving weights through ``checkpoint_engine.backend = nereus``:
verl's own ``CheckpointEngineManager``, ``RayWorkerGroup``, ``RayResourcePool`` and
``CheckpointEngineWorker`` on a local Ray cluster, 2 trainer and 2 rollout workers on CPU, the
backend loaded out of verl's tree by ``custom_backend_module`` (``nereus.integrations.verl``).
One run of ``nereus bench verl --quick --json`` in a process of its own serves every test: per
backend three updates, each of new weights (the first makes the group, the others reuse it),
Nereus's and verl's NCCL engine's algorithm (``verl-broadcast``) side by side."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
pytest.importorskip("zmq")  # verl.checkpoint_engine imports it (pyzmq; fastapi and uvicorn too)

from tests.cli.test_cli import bench_json  # noqa: E402

UPDATES, TRAINERS, ROLLOUTS = 3, 2, 2


@pytest.fixture(scope="module")
def bench():
    return bench_json("verl", timeout=1200)  # two backends on Ray: minutes on a loaded 2-core machine


@pytest.mark.slow
def test_the_bench_prints_one_json_document_with_both_ways_bit_exact(bench):
    """The document alone on stdout (``bench_json`` parses all of it), both backends bit-exact,
    Nereus's busiest sender half the broadcast root's (two trainers share the sending)."""
    assert (bench["trainers"], bench["rollouts"]) == (TRAINERS, ROLLOUTS)
    assert set(bench["ways"]) == {"nereus", "verl-broadcast"}
    for way in bench["ways"].values():
        assert way["exact"], way
    assert bench["ways"]["nereus"]["received"] == bench["model_bytes"]
    # the broadcast also sends its buckets' metadata (names, shapes, offsets: verl's over zmq)
    assert bench["model_bytes"] < bench["ways"]["verl-broadcast"]["received"] < 1.01 * bench["model_bytes"]
    assert bench["broadcast_over_nereus"]["busiest_sender"] > 1.9


@pytest.mark.slow
def test_every_rollout_worker_receives_every_tensor_bit_exact_at_every_update(bench):
    updates = bench["ways"]["nereus"]["updates"]
    assert len(updates) == UPDATES
    for u in updates:
        assert len(u["rollout"]) == ROLLOUTS
        for r in u["rollout"]:
            assert r["names"] and r["exact"], u  # this update's weights, not the last one's


@pytest.mark.slow
def test_each_rollout_worker_receives_the_model_once_and_the_trainers_share_the_sending(bench):
    model, updates = bench["model_bytes"], bench["ways"]["nereus"]["updates"]
    for u in updates:
        assert [r["received"] for r in u["rollout"]] == [model] * ROLLOUTS, u
        sent = [t["sent"] for t in u["trainer"]] + [r["sent"] for r in u["rollout"]]
        assert sum(sent) == ROLLOUTS * model, u  # every byte sent once per receiver: nothing more
        trainers = [t["sent"] for t in u["trainer"]]
        # every trainer worker sends, about alike (verl's NCCL engine sends from trainer rank 0 alone)
        assert min(trainers) > 0 and max(trainers) <= 1.1 * min(trainers), u
