"""verl's checkpoint-engine layer moving weights through ``checkpoint_engine.backend = nereus``:
verl's own ``CheckpointEngineManager``, ``RayWorkerGroup``, ``RayResourcePool`` and
``CheckpointEngineWorker`` on a local Ray cluster, 2 trainer and 2 rollout workers on CPU, the
backend loaded out of verl's tree by ``custom_backend_module`` (``nereus.integrations.verl``),
driven by ``nereus bench verl``'s harness. Three updates, each of new weights: the first makes
the group, the others reuse it."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
pytest.importorskip("zmq")  # verl.checkpoint_engine imports it (pyzmq; fastapi and uvicorn too)

UPDATES, TRAINERS, ROLLOUTS = 3, 2, 2


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    import ray

    from nereus.bench import verl_bench as vb

    path = str(vb.model_dir(tmp_path_factory.mktemp("verl") / "model"))
    vb.ray_init(TRAINERS + ROLLOUTS)
    try:
        model = sum(t.numel() * t.element_size() for t in vb.weights(path, 0).values())
        return model, vb.sync_run(path, "nereus", UPDATES, TRAINERS, ROLLOUTS)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_every_rollout_worker_receives_every_tensor_bit_exact_at_every_update(synced):
    _, updates = synced
    assert len(updates) == UPDATES
    for u in updates:
        for r in u["rollout"]:
            assert r["names"] and r["exact"], u  # this update's weights, not the last one's


@pytest.mark.slow
def test_each_rollout_worker_receives_the_model_once_and_the_trainers_share_the_sending(synced):
    model, updates = synced
    for u in updates:
        assert [r["received"] for r in u["rollout"]] == [model] * ROLLOUTS, u
        sent = [t["sent"] for t in u["trainer"]] + [r["sent"] for r in u["rollout"]]
        assert sum(sent) == ROLLOUTS * model, u  # every byte sent once per receiver: nothing more
        trainers = [t["sent"] for t in u["trainer"]]
        # every trainer worker sends, about alike (verl's NCCL engine sends from trainer rank 0 alone)
        assert min(trainers) > 0 and max(trainers) <= 1.1 * min(trainers), u
