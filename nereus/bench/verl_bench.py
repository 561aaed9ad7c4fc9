"""``nereus bench verl``: weight updates through verl's own checkpoint-engine layer, Nereus's
backend against verl's NCCL engine's algorithm, side by side in one run.

verl 0.9.1's ``CheckpointEngineManager``, ``RayWorkerGroup``, ``RayResourcePool`` and
``CheckpointEngineWorker`` on a local Ray cluster: 2 trainer workers and 2 rollout workers on CPU,
each a Ray actor. Per backend, one set of workers; ``reps`` updates after a warm-up one, each of
new weights (the trainer's weights at that step, the same on every trainer worker, as verl's
``get_per_tensor_param`` hands them over after a data-parallel step):

- **nereus**: ``checkpoint_engine.backend = nereus`` (``nereus.integrations.verl``), loaded by
  ``custom_backend_module`` as a user loads it: the sending spread over both trainer workers;
- **verl-broadcast**: verl's NCCL engine's algorithm on gloo (``baselines/verl_broadcast.py``):
  trainer rank 0 broadcasts buckets of ``update_weights_bucket_megabytes`` (verl's default,
  2,048 MB) to the rollout workers.

As in verl's own checkpoint-engine tests, the rollout workers' server adapter keeps what arrives
(verl's vLLM server adapter needs a GPU engine), and every update is checked bit for bit against
the trainer's weights for both ways. Per update: the manager's wall time (``update_weights``:
verl's prepare, topology, group set-up, the transfer and finalize, alike for both), CPU seconds
of every worker process summed (``time.process_time``), and bytes: what each rollout worker
received and what the busiest sender sent (Nereus: the executor's count; the broadcast: its
payload times its receivers, what gloo's broadcast from one root sends).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

BACKENDS = {"nereus": "nereus.integrations.verl", "verl-broadcast": "nereus.bench.baselines.verl_broadcast"}


def model_dir(where: Path, hidden: int = 64, layers: int = 2, vocab: int = 128) -> Path:
    """A Llama's ``config.json`` (float32): the trainer workers build it, the backend plans from it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
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


def weights(path: str, version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``version``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(version)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _classes():
    """verl's worker classes for the run, made where verl is imported (a Ray actor re-imports this module)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.utils.import_utils import import_external_libs
    from verl.workers.rollout import BaseRollout, RolloutReplica

    class Trainer(Worker):
        """A trainer worker as verl's checkpoint-engine tests write one: its engine is handed
        every tensor whole, by Hugging Face name (``get_per_tensor_param``'s contract)."""

        def __init__(self, ce_config, path: str):
            super().__init__()
            import_external_libs(ce_config.custom_backend_module)
            kwargs = dict(ce_config.engine_kwargs.get(ce_config.backend, {}))
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce_config.backend,
                bucket_size=ce_config.update_weights_bucket_megabytes << 20,
                is_master=self.rank == 0,
                **kwargs,
            )
            self.path, self.state = path, {}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def step(self, version: int):
            self.state = weights(self.path, version)  # made before the update: not its cost

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            return await self.checkpoint_engine.send_weights(iter(self.state.items()), global_steps=global_steps)

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def traffic(self):
            ce = self.checkpoint_engine
            return {"sent": ce.sent, "received": ce.received, "cpu": time.process_time(), "push_s": ce.seconds}

    class Keeper(BaseRollout):
        """The rollout workers' server adapter: keeps every tensor it is given."""

        def __init__(self, config, model_config):
            super().__init__(config, model_config, device_mesh=None)
            self.got: dict[str, torch.Tensor] = {}

        async def resume(self, tags):
            pass

        async def release(self):
            pass

        async def update_weights(self, weights, **kwargs):
            async for name, tensor in weights:
                self.got[name] = tensor

    class Rollout(CheckpointEngineWorker):
        def __init__(self, rollout_config, model_config):
            super().__init__(rollout_config, model_config, Keeper(rollout_config, model_config))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def check(self, version: int, path: str):
            """Whether every tensor arrived, bit for bit; the traffic; then forget them."""
            got, self.server_adapter.got = self.server_adapter.got, {}
            want = weights(path, version)
            ce = self.checkpoint_engine
            return {
                "names": sorted(got) == sorted(want),
                "exact": all(torch.equal(t, want[n]) for n, t in got.items()),
                "sent": ce.sent,
                "received": ce.received,
                "push_s": ce.seconds,
            }

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def cpu(self):
            return time.process_time()

    class Replica(RolloutReplica):
        async def init_hybrid(self, worker_group):
            n = self.world_size
            self.workers = worker_group.workers[n * self.replica_rank : n * (self.replica_rank + 1)]

        def get_ray_class_with_init_args(self):
            raise NotImplementedError

        async def launch_servers(self):
            raise NotImplementedError

    return Trainer, Rollout, Replica


def sync_run(path: str, backend: str, updates: int, trainers: int = 2, rollouts: int = 2, bucket_mb: int = 2048):
    """``updates`` weight updates through verl's manager with ``backend``; per update, each
    rollout worker's check and traffic, the trainers' traffic, the manager's seconds and the CPU
    seconds of every worker. Needs ``ray.init`` done."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    Trainer, Rollout, Replica = _classes()
    ce_config = CheckpointEngineConfig(
        backend=backend,
        custom_backend_module=BACKENDS[backend],
        update_weights_bucket_megabytes=bucket_mb,
        engine_kwargs={backend: {"model": path, "timeout": 120.0} if backend == "nereus" else {"timeout": 120.0}},
    )
    model_config = HFModelConfig(path=path, load_tokenizer=False)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=ce_config, tensor_model_parallel_size=1)
    pool = RayResourcePool(process_on_nodes=[trainers + rollouts], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [trainers, rollouts])
    actor_wg = RayWorkerGroup(
        resource_pool=trainer_pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Trainer), ce_config=ce_config, path=path),
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
    out = []
    try:
        for version in range(1, updates + 1):
            actor_wg.step(version)
            cpu0 = sum(t["cpu"] for t in actor_wg.traffic()) + sum(rollout_wg.cpu())
            t0 = time.perf_counter()
            manager.update_weights(global_steps=version)  # verl runs it to completion (auto_await)
            seconds = time.perf_counter() - t0
            trainer = actor_wg.traffic()
            cpu = sum(t["cpu"] for t in trainer) + sum(rollout_wg.cpu()) - cpu0
            out.append(
                {"seconds": seconds, "cpu_s": cpu, "trainer": trainer, "rollout": rollout_wg.check(version, path)}
            )
    finally:
        for wg in (actor_wg, rollout_wg):
            for w in wg.workers:
                ray.kill(w)
        pool_pgs = getattr(pool, "pgs", None) or []
        for pg in pool_pgs:
            ray.util.remove_placement_group(pg)
    return out


def ray_init(workers: int) -> None:
    """A local Ray cluster for the workers; this checkout importable by them."""
    import ray

    root = str(Path(__file__).resolve().parents[2])
    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}},
    )


def run(quick: bool = False, json_output: bool = False) -> dict:
    import ray

    hidden, layers, vocab, reps = (128, 2, 1024, 2) if quick else (512, 4, 8192, 5)
    result: dict = {"benchmark": "verl", "trainers": 2, "rollouts": 2, "ways": {}}
    with tempfile.TemporaryDirectory(prefix="nereus-verl-") as tmp:
        path = str(model_dir(Path(tmp) / "model", hidden, layers, vocab))
        model_bytes = sum(t.numel() * t.element_size() for t in weights(path, 0).values())
        result["model_bytes"] = model_bytes
        ray_init(4)
        try:
            for backend in BACKENDS:
                updates = sync_run(path, backend, reps + 1)
                rounds = updates[1:]  # the first: warm-up (plans, imports, the group)
                result["ways"][backend] = {
                    "exact": all(r["names"] and r["exact"] for u in rounds for r in u["rollout"]),
                    "seconds": statistics.median(u["seconds"] for u in rounds),
                    "cpu_s": statistics.median(u["cpu_s"] for u in rounds),
                    "received": max(r["received"] for u in rounds for r in u["rollout"]),
                    "busiest_sender": max(t["sent"] for u in rounds for t in u["trainer"]),
                    "updates": updates,  # every update's record, the warm-up's first
                }
        finally:
            ray.shutdown()
    n, b = result["ways"]["nereus"], result["ways"]["verl-broadcast"]
    result["broadcast_over_nereus"] = {k: b[k] / n[k] for k in ("seconds", "cpu_s", "busiest_sender")}
    if not json_output:
        t = Table(
            title=f"Weight updates through verl's manager, 2 trainer + 2 rollout Ray workers: Llama "
            f"({model_bytes / 2**20:.1f} MiB fp32), median of {reps}",
            title_justify="left",
        )
        for col in (
            "backend",
            "bit-exact",
            "update (wall)",
            "CPU s, all workers",
            "received per rollout",
            "busiest sender",
        ):
            t.add_column(col, justify="right")
        for name, w in result["ways"].items():
            t.add_row(
                name,
                "yes" if w["exact"] else "NO",
                f"{w['seconds'] * 1e3:.0f} ms",
                f"{w['cpu_s']:.3f}",
                f"{w['received'] / 2**20:.2f} MiB",
                f"{w['busiest_sender'] / 2**20:.2f} MiB",
            )
        Console(width=200).print(t)
        r = result["broadcast_over_nereus"]
        Console().print(
            f"verl-broadcast / nereus: wall {r['seconds']:.2f}x, CPU {r['cpu_s']:.2f}x, "
            f"busiest sender {r['busiest_sender']:.2f}x"
        )
    return result
