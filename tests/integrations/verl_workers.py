"""The Ray side of ``test_verl.py``: verl's own ``CheckpointEngineManager``, ``RayWorkerGroup``,
``RayResourcePool`` and ``CheckpointEngineWorker`` moving a tiny Llama's weights from 2 trainer
workers to 2 rollout workers through ``checkpoint_engine.backend = nereus``, loaded as an
out-of-tree module (``custom_backend_module``).

As in verl's own checkpoint-engine tests (``tests/checkpoint_engine/test_utils.py`` in its
wheel), the trainer workers hand their engine every tensor whole by Hugging Face name (what
``get_per_tensor_param`` yields) and the rollout workers' server adapter keeps what arrives
(verl's vLLM server adapter needs a GPU engine); the test compares it with the trainer's
tensors bit for bit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch

BACKEND_MODULE = "nereus.integrations.verl"


def tiny_model_dir(where: Path) -> Path:
    """A tiny Llama's ``config.json`` (float32), for the trainer workers and the backend's plan."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    where.mkdir(parents=True, exist_ok=True)
    d = cfg.to_dict()
    d.update(torch_dtype="float32", architectures=["LlamaForCausalLM"])
    (where / "config.json").write_text(json.dumps(d, indent=1))
    return where


def weights(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version`` (every trainer rank the same, as after a DP step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(version)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(model_dir: str, updates: int = 2, trainers: int = 2, rollouts: int = 2) -> dict:
    """``updates`` weight updates through verl's manager; what every rollout worker received
    against the trainer's weights, and each worker's bytes sent and received."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout import BaseRollout, RolloutReplica

    class Trainer(Worker):
        """A trainer worker as verl's checkpoint-engine tests write one: its engine is handed every
        tensor whole (``get_per_tensor_param``'s contract)."""

        def __init__(self, ce_config: CheckpointEngineConfig, model_dir: str):
            super().__init__()
            import_external_libs(ce_config.custom_backend_module)
            kwargs = dict(ce_config.engine_kwargs.get(ce_config.backend, {}))
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce_config.backend, bucket_size=ce_config.update_weights_bucket_megabytes << 20, **kwargs
            )
            self.model_dir, self.version = model_dir, 0

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def step(self, version: int):
            self.version = version

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            state = weights(self.model_dir, self.version)
            return await self.checkpoint_engine.send_weights(iter(state.items()), global_steps=global_steps)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def traffic(self):
            ce = self.checkpoint_engine
            return {"sent": ce.sent, "received": ce.received}

    class Keeper(BaseRollout):
        """The rollout workers' server adapter: keeps every tensor it is given (``update_weights``)."""

        def __init__(self, config, model_config):
            super().__init__(config, model_config, device_mesh=None)
            self.got: dict[str, torch.Tensor] = {}

        async def resume(self, tags):
            pass

        async def release(self):
            pass

        async def update_weights(self, weights, **kwargs):
            async for name, tensor in weights:
                self.got[name] = tensor.clone()

    class Rollout(CheckpointEngineWorker):
        def __init__(self, rollout_config, model_config):
            super().__init__(rollout_config, model_config, Keeper(rollout_config, model_config))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def received(self):
            got = self.server_adapter.got
            self.server_adapter.got = {}
            ce = self.checkpoint_engine
            return {"tensors": got, "sent": ce.sent, "received": ce.received}

    class Replica(RolloutReplica):
        async def init_hybrid(self, worker_group):
            self.workers = worker_group.workers[
                self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)
            ]

        def get_ray_class_with_init_args(self):
            raise NotImplementedError

        async def launch_servers(self):
            raise NotImplementedError

    ce_config = CheckpointEngineConfig(
        backend="nereus",
        custom_backend_module=BACKEND_MODULE,
        update_weights_bucket_megabytes=16,
        engine_kwargs={"nereus": {"model": model_dir, "timeout": 120.0}},
    )
    model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce_config, tensor_model_parallel_size=1)

    pool = RayResourcePool(process_on_nodes=[trainers + rollouts], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [trainers, rollouts])
    actor_wg = RayWorkerGroup(
        resource_pool=trainer_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer), ce_config=ce_config, model_dir=model_dir),
        device_name="cpu",
    )
    rollout_wg = RayWorkerGroup(
        resource_pool=rollout_pool,
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(Rollout), rollout_config=rollout_config, model_config=model_config
        ),
        device_name="cpu",
    )
    replicas = [Replica(replica_rank=i, config=rollout_config, model_config=model_config) for i in range(rollouts)]

    async def init():
        await asyncio.gather(*[r.init_hybrid(rollout_wg) for r in replicas])

    asyncio.run(init())
    manager = CheckpointEngineManager(config=ce_config, actor_wg=actor_wg, replicas=replicas)
    out: dict = {"updates": []}
    for version in range(1, updates + 1):
        actor_wg.step(version)
        manager.update_weights(global_steps=version)  # verl runs it to completion (auto_await)
        want = weights(model_dir, version)
        got = rollout_wg.received()
        out["updates"].append(
            {
                "names": [sorted(g["tensors"]) == sorted(want) for g in got],
                "exact": [all(torch.equal(t, want[n]) for n, t in g["tensors"].items()) for g in got],
                "rollout": [{"sent": g["sent"], "received": g["received"]} for g in got],
                "trainer": actor_wg.traffic(),
            }
        )
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in want.values())
    return out
