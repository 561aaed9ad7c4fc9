"""verl's checkpoint-engine layer moving weights through ``checkpoint_engine.backend = nereus``:
verl's own ``CheckpointEngineManager``, ``RayWorkerGroup`` and ``CheckpointEngineWorker`` on a
local Ray cluster, 2 trainer and 2 rollout workers on CPU, the backend loaded out of verl's tree
by ``custom_backend_module`` (``nereus.integrations.verl``). Two updates, each of new weights."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
pytest.importorskip("zmq")  # verl.checkpoint_engine's imports (uvicorn, fastapi, pyzmq)

from . import verl_workers as w  # noqa: E402

UPDATES, TRAINERS, ROLLOUTS = 2, 2, 2


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    import os
    from pathlib import Path

    import ray

    root = str(Path(__file__).resolve().parents[2])
    model_dir = w.tiny_model_dir(tmp_path_factory.mktemp("verl") / "model")
    ray.init(
        num_cpus=TRAINERS + ROLLOUTS,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}},
    )
    try:
        return w.run(str(model_dir), UPDATES, TRAINERS, ROLLOUTS)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_every_rollout_worker_receives_every_tensor_bit_exact_at_every_update(synced):
    assert len(synced["updates"]) == UPDATES
    for u in synced["updates"]:
        assert u["names"] == [True] * ROLLOUTS, u
        assert u["exact"] == [True] * ROLLOUTS, u  # this update's weights, not the last one's


@pytest.mark.slow
def test_each_rollout_worker_receives_the_model_once_and_the_trainers_share_the_sending(synced):
    model = synced["model_bytes"]
    for u in synced["updates"]:
        assert [r["received"] for r in u["rollout"]] == [model] * ROLLOUTS, u
        sent = [t["sent"] for t in u["trainer"]] + [r["sent"] for r in u["rollout"]]
        assert sum(sent) == ROLLOUTS * model, u  # every byte sent once per receiver: nothing more
        trainers = [t["sent"] for t in u["trainer"]]
        # every trainer worker sends, about alike (verl's NCCL engine sends from trainer rank 0 alone)
        assert min(trainers) > 0 and max(trainers) <= 1.1 * min(trainers), u
