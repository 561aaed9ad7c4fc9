"""``nereus bench push``: the actor's weights from the trainer to a vLLM engine on every rank,
Nereus against the ways RL frameworks push them today, side by side in one run.

4 gloo processes hold a Hugging Face ``LlamaForCausalLM`` (built from a config, seeded) under the
trainer's layout (``nereus.integrations.hf_llama``); every rank needs the whole model for its
engine (vLLM's CPU build takes whole tensors and cuts its own shards). Three ways, each run
``reps`` times per layout after a warm-up round, the slowest rank's median, and each checked bit for bit against the
others:

- **nereus**: ``WeightPush`` (the transition planned and lowered once, ``execute`` per push):
  each rank receives the slices it lacks, from the ranks that hold them;
- **verl-like** (all-gather within the TP group, as verl does from Megatron; under PP each stage
  then broadcasts its layers to the other stages): every TP-sharded tensor of the rank's stage is
  packed into one buffer and gathered with one ``all_gather_single``, each PP stage's whole
  layers go out in one ``broadcast`` per stage; replicated tensors (norms) stay where they are;
- **OpenRLHF-like** (the whole model assembled on rank 0, then one broadcast to every engine):
  the TP shards gathered to rank 0 (``gather`` of one packed buffer per rank), rank 0 assembles
  the model and broadcasts it packed in one buffer.

What a way knows before a push (Nereus: its lowered program; the peers: ``metadata``, every
stage's tensors, every rank's packed size and boxes) is made once per layout, outside the timing.

CPU seconds (``time.process_time`` of every rank in the push, summed over the ranks, the median
round) are reported beside the wall times: stable where wall time on a shared 2-core machine is
not.

Bytes received per rank are counted for each way against the lower bound (what the rank lacks,
from the live parameters). With vLLM installed, each rank also starts an engine, and the push is
timed end to end, up to the engine serving the new weights:

- **nereus**: ``WeightPush.push_into``: the transition in waves of rounds (the model in the order
  the engine loads it, one wave per layer plus the first and last stages' tensors), each wave
  handed to the engine's ``reload_weights`` as it lands while the next is on the wire;
- **verl-like**: the same all-gather and broadcasts, bucketed by the same waves, each bucket
  handed to the engine as it is gathered while the next is gathered (verl's checkpoint engine
  receives a bucket while the engine loads the last: ``_receive_weight_chunks``);
- **OpenRLHF-like**: the broadcast, then the engine's load (OpenRLHF's vLLM worker receives a
  tensor, then loads it: no overlap);
- **nereus, load after**: ``push``, then the engine's load: what the overlap gains, measured in the
  same rounds.

Both overlapped ways run the same thread-and-queue code (``weight_push.load_behind``). The
engine's load alone (``reload_weights`` of the whole model, all four engines at once after a
barrier) is timed too: the same work whatever the push.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from ..backend.lower import load_wave
from ..integrations.hf_llama import build, ir_model
from ..integrations.job import layout, training_job
from ..integrations.llama_state import check_layout
from ..integrations.weight_push import WeightPush, hf_name, load_behind
from ..runtime.launch import init_from_env, run_local

WORLD = 4
LAYOUTS = {"tp2xdp2": (2, 1, 2), "pp2xtp2": (2, 2, 1), "tp4": (4, 1, 1)}  # (tp, pp, dp)


def _config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )


def _shard_dim(placements) -> int | None:
    """The tensor dim a TP placement shards (None: replicated)."""
    if placements is None:
        return None
    (p,) = placements
    return getattr(p, "dim", None)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def verl_like(live, meta: dict, only: set[str] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """All-gather within the TP group, then each PP stage broadcasts its layers; (named, bytes
    received). ``only``: the IR names of one bucket (default: every tensor)."""
    lay, mesh = live.layout, live.mesh
    params = live.params()
    names = sorted(n for n in params if only is None or n in only)
    full: dict[str, torch.Tensor] = {}
    received = 0
    sharded = [n for n in names if _shard_dim(live.placements[n]) is not None]
    for n in names:
        if n not in sharded:
            full[n] = params[n].detach()
    if lay.tp > 1 and sharded:
        local = [
            params[n].detach().to_local() if hasattr(params[n], "to_local") else params[n].detach() for n in sharded
        ]
        buf = _pack(local)
        out = torch.empty(lay.tp * buf.numel(), dtype=buf.dtype)
        dist.all_gather_single(out, buf, group=mesh["tp"].get_group())
        received += (lay.tp - 1) * buf.numel() * buf.element_size()
        parts = out.view(lay.tp, -1)
        offset = 0
        for n, t in zip(sharded, local):
            k = t.numel()
            pieces = [parts[r, offset : offset + k].view(t.shape) for r in range(lay.tp)]
            full[n] = torch.cat(pieces, dim=_shard_dim(live.placements[n]))
            offset += k
    if lay.pp > 1:  # every stage's whole tensors to the other stages, one broadcast per stage
        group, stage = mesh["pp"].get_group(), live.coordinate[1]
        for s in range(lay.pp):
            shapes = [(n, sh) for n, sh in meta["stage_shapes"][s] if only is None or n in only]
            if not shapes:
                continue
            if s == stage:
                buf = _pack([full[n] for n, _ in shapes])
            else:
                buf = torch.empty(sum(torch.Size(sh).numel() for _, sh in shapes), dtype=torch.float32)
            dist.broadcast(buf, group_src=s, group=group)
            if s != stage:
                received += buf.numel() * buf.element_size()
                offset = 0
                for n, sh in shapes:
                    k = torch.Size(sh).numel()
                    full[n] = buf[offset : offset + k].view(sh)
                    offset += k
    return {hf_name(n): t for n, t in full.items()}, received


def wave_buckets(live, meta: dict, waves: int) -> list[set[str]]:
    """The model's tensors in ``waves`` runs, in the engine's load order (Nereus's waves): the
    verl-like way's buckets, made once per layout outside the timed pushes, as Nereus's program is."""
    model = ir_model(live.config, live.layout.model)
    every = {n for stage in meta["stage_shapes"] for n, _ in stage}
    return [{n for n in every if load_wave(model, n, waves) == w} for w in range(waves)]


def verl_like_into(engine, live, meta: dict, buckets: list[set[str]]) -> tuple[dict[str, torch.Tensor], int]:
    """``verl_like`` bucket by bucket (``wave_buckets``), each bucket loaded by ``engine`` while
    the next is gathered."""

    def push(put):
        named, received = {}, 0
        for bucket in buckets:
            got, n = verl_like(live, meta, bucket)
            put(list(got.items()))
            named.update(got)
            received += n
        return named, received

    return load_behind(engine, push)


def _stage_shapes(live, stage: int) -> list[tuple[str, tuple]]:
    """(IR name, full shape) of the tensors pipeline stage ``stage`` holds, in a fixed order."""
    model = ir_model(live.config, live.layout.model)
    lo, hi = live.layout.layers[stage]
    out = []
    for name, spec in sorted(model.tensors.items()):
        if spec.placement == "layer":
            for i in range(lo, hi + 1):
                out.append((f"layers.{i}.{name}", spec.shape))
        elif (spec.placement in ("first", "first_and_last") and stage == 0) or (
            spec.placement in ("last", "first_and_last") and stage == live.layout.pp - 1
        ):
            out.append((name, spec.shape))
    return sorted(out)


def metadata(live) -> dict:
    """What the peers know before a push, as Nereus knows its lowered program: the tensors of
    every pipeline stage, every rank's packed size and (on rank 0) every rank's boxes. Made
    once per layout, outside the timed pushes (collectives: every rank calls it)."""
    world = dist.get_world_size()
    mine = sum(torch.Size([hi - lo for lo, hi in box]).numel() for _, box in live.boxes.values())
    sizes = torch.tensor([mine], dtype=torch.int64)
    every = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(every, sizes)
    boxes = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(live.boxes, boxes, dst=0)
    return {
        "stage_shapes": [_stage_shapes(live, s) for s in range(live.layout.pp)],
        "biggest": max(int(x) for x in every),
        "boxes": boxes,
    }


def openrlhf_like(live, meta: dict) -> tuple[dict[str, torch.Tensor], int]:
    """The whole model assembled on rank 0, then broadcast packed to every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = live.params()
    mine = sorted(params)
    local = _pack(
        [(params[n].detach().to_local() if hasattr(params[n], "to_local") else params[n].detach()) for n in mine]
    )
    biggest = meta["biggest"]
    padded = torch.zeros(biggest, dtype=torch.float32)
    padded[: local.numel()] = local
    gathered = [torch.empty(biggest, dtype=torch.float32) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    shapes = {n: sh for stage in meta["stage_shapes"] for n, sh in stage}
    order = sorted(shapes)
    total = sum(torch.Size(shapes[n]).numel() for n in order)
    flat = torch.empty(total, dtype=torch.float32)
    if rank == 0:  # assemble: each rank's shards placed by the boxes the ranks hold
        full = {n: torch.empty(shapes[n]) for n in order}
        boxes = meta["boxes"]
        for r in range(world):
            offset = 0
            for n in sorted(boxes[r]):
                shape, box = boxes[r][n]
                k = 1
                for lo_, hi_ in box:
                    k *= hi_ - lo_
                region = tuple(slice(lo_, hi_) for lo_, hi_ in box)
                full[n][region] = gathered[r][offset : offset + k].view([hi_ - lo_ for lo_, hi_ in box])
                offset += k
        torch.cat([full[n].reshape(-1) for n in order], out=flat)
    dist.broadcast(flat, src=0)
    received = (biggest * world * 4 if rank == 0 else 0) + (flat.numel() * 4 if rank != 0 else 0)
    out, offset = {}, 0
    for n in order:
        k = torch.Size(shapes[n]).numel()
        out[hf_name(n)] = flat[offset : offset + k].view(shapes[n])
        offset += k
    return out, received


def then_load(engine, pushed: tuple[dict[str, torch.Tensor], int]) -> tuple[dict[str, torch.Tensor], int]:
    """A push's (named, bytes received), after the engine's load of what arrived: in series, as
    OpenRLHF's vLLM worker loads what it received."""
    engine.load(pushed[0])
    return pushed


def timed(ways: dict, reps: int, check=None) -> tuple[dict, dict, dict]:
    """Each way ``reps`` times after a warm-up round (first collectives, allocations), every
    rank at once after a barrier: the wall seconds and this rank's CPU seconds of each round, per
    way, and each way's last result. ``check(way, result)`` runs on every result, untimed."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    last = {}
    for rep in range(reps + 1):
        for way, fn in ways.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            last[way] = fn()
            if rep:
                cpu[way].append(time.process_time() - c0)
                times[way].append(time.perf_counter() - t0)
            if check is not None:
                check(way, last[way])
    return times, cpu, last


def same(ref: dict[str, torch.Tensor], named: dict[str, torch.Tensor], what: str) -> None:
    """Raise unless ``named`` holds the tensors of ``ref``, bit for bit."""
    if set(named) != set(ref) or any(not torch.equal(named[k], ref[k]) for k in ref):
        raise AssertionError(f"{what} pushed other weights than nereus")


def worker(rank: int, world: int, hidden: int, layers: int, vocab: int, reps: int, engines: bool, tmp: str) -> dict:
    init_from_env(timeout=600)
    cfg = _config(hidden, layers, vocab)
    model = ir_model(cfg)
    engine = None
    if engines:
        from ..integrations.vllm_engine import VllmEngine

        engine = VllmEngine(cfg, f"{tmp}/engine-{rank}", max_model_len=128)
    out: dict = {}
    for name, (tp, pp, dp) in LAYOUTS.items():
        lay = layout(model, tp=tp, pp=pp, dp=dp)
        check_layout(training_job(model, {"a": lay}, world), "a", lay.model_stage)
        live = build(cfg, lay, seed=0, timeout=300)
        pusher = WeightPush(model, lay, list(range(world)), world, timeout=300)
        meta = metadata(live)
        bound = sum(
            (torch.Size(full).numel() - torch.Size([hi - lo for lo, hi in box]).numel()) * 4
            for full, box in live.boxes.values()
        ) + sum(
            torch.Size(sh).numel() * 4
            for s in range(pp)
            if s != live.coordinate[1]
            for _, sh in meta["stage_shapes"][s]
        )
        ways = {
            "nereus": lambda: (pusher.push(live), pusher.stats.bytes_received),
            "verl": lambda: verl_like(live, meta),
            "openrlhf": lambda: openrlhf_like(live, meta),
        }
        times, cpu, results = timed(ways, reps)
        ref = results["nereus"][0]
        for way, (named, _) in results.items():
            same(ref, named, f"{name}: {way}")
        out[name] = {way: statistics.median(t) for way, t in times.items()}
        out[name].update({f"{way}_bytes": results[way][1] for way in ways}, bound=bound)
        out[name]["cpu"] = cpu
        if engine is not None:
            loads, load_cpu = [], []
            for _ in range(reps):
                dist.barrier()  # every rank's engine loads at once, as after a push
                c0 = time.process_time()
                loads.append(engine.load(ref))
                load_cpu.append(time.process_time() - c0)
            out[name]["load"] = statistics.median(loads)
            out[name]["cpu"]["load"] = load_cpu
            # end to end, up to the engine serving the new weights (CPU seconds: every thread of the rank)
            buckets = wave_buckets(live, meta, pusher.waves)
            e2e = {
                "nereus": lambda: (pusher.push_into(engine, live), pusher.stats.bytes_received),
                "nereus_serial": lambda: then_load(engine, (pusher.push(live), pusher.stats.bytes_received)),
                "verl": lambda: verl_like_into(engine, live, meta, buckets),
                "openrlhf": lambda: then_load(engine, openrlhf_like(live, meta)),
            }
            e2e_times, e2e_cpu, _ = timed(e2e, reps, lambda way, got: same(ref, got[0], f"{name}: {way} end to end"))
            for way in e2e:
                out[name][f"{way}_e2e"] = statistics.median(e2e_times[way])
                out[name]["cpu"][f"{way}_e2e"] = e2e_cpu[way]
            out[name]["waves"] = pusher.waves
    if engine is not None:
        dist.barrier()
        engine.close()  # last: its teardown destroys the default group
    return out


def run(quick: bool = False, json_output: bool = False, engines: bool | None = None) -> dict:
    hidden, layers, vocab, reps = (256, 2, 1024, 3) if quick else (512, 4, 8192, 5)
    if engines is None:
        try:
            import vllm  # noqa: F401

            engines = True
        except ImportError:
            engines = False
    with tempfile.TemporaryDirectory(prefix="nereus-push-") as tmp:
        per_rank = run_local(worker, WORLD, hidden, layers, vocab, reps, engines, tmp, timeout=1800, threads=1)
    cfg = _config(hidden, layers, vocab)
    params = ir_model(cfg).num_params()
    result = {"benchmark": "push", "world": WORLD, "params": params, "engines": engines, "layouts": {}}
    for name in LAYOUTS:
        row = {k: max(r[name][k] for r in per_rank) for k in per_rank[0][name] if k != "cpu"}
        for way in ("nereus", "verl", "openrlhf"):  # all ranks' CPU seconds in a round, the median round
            row[f"{way}_cpu_s"] = statistics.median(map(sum, zip(*(r[name]["cpu"][way] for r in per_rank))))
        row["best_peer_cpu_over_nereus"] = min(row["verl_cpu_s"], row["openrlhf_cpu_s"]) / row["nereus_cpu_s"]
        row["bytes_at_bound"] = all(r[name]["nereus_bytes"] == r[name]["bound"] for r in per_rank)
        best = min(row["verl"], row["openrlhf"])
        row["best_peer_over_nereus"] = best / row["nereus"]
        if engines:
            for way in ("nereus", "nereus_serial", "verl", "openrlhf"):
                row[f"{way}_e2e_cpu_s"] = statistics.median(
                    map(sum, zip(*(r[name]["cpu"][f"{way}_e2e"] for r in per_rank)))
                )
            best_e2e = min(row["verl_e2e"], row["openrlhf_e2e"])
            row["end_to_end_ratio"] = best_e2e / row["nereus_e2e"]
            best_cpu = min(row["verl_e2e_cpu_s"], row["openrlhf_e2e_cpu_s"])
            row["end_to_end_cpu_ratio"] = best_cpu / row["nereus_e2e_cpu_s"]
            # Nereus's own push with the load after it, measured in the same rounds: what the overlap gains
            row["overlap_gain"] = row["nereus_serial_e2e"] / row["nereus_e2e"]
            # the engines' load in CPU seconds over the ranks; with the push's, what any overlap of
            # the two must still run on this machine's cores: the fastest end to end it allows
            row["load_cpu_s"] = statistics.median(map(sum, zip(*(r[name]["cpu"]["load"] for r in per_rank))))
            # the ranks run one thread each (``run_local(threads=1)``): at most WORLD cores serve them
            cores = min(len(os.sched_getaffinity(0)), WORLD)
            row["end_to_end_cpu_floor"] = (row["nereus_cpu_s"] + row["load_cpu_s"]) / cores
            row["end_to_end_ratio_bound"] = best_e2e / max(row["end_to_end_cpu_floor"], row["nereus"], row["load"])
        result["layouts"][name] = row
    if not json_output:
        size = f"{params / 1e6:.1f} M params, {params * 4 / 2**20:.0f} MiB fp32"
        title = f"on each of {WORLD} gloo processes: HF Llama ({size})"
        t = Table(title=f"The transfer to an engine {title}", title_justify="left")
        for col in ("trainer layout", "nereus", "verl-like", "OpenRLHF-like", "best peer / nereus"):
            t.add_column(col, justify="right")
        t.add_column("CPU s, all ranks: nereus / verl-like / OpenRLHF-like", justify="right")
        t.add_column("nereus bytes = bound", justify="right")
        for name, row in result["layouts"].items():
            t.add_row(
                name,
                f"{row['nereus'] * 1e3:.1f} ms",
                f"{row['verl'] * 1e3:.1f} ms",
                f"{row['openrlhf'] * 1e3:.1f} ms",
                f"{row['best_peer_over_nereus']:.2f}x",
                f"{row['nereus_cpu_s']:.3f} / {row['verl_cpu_s']:.3f} / {row['openrlhf_cpu_s']:.3f}",
                "yes" if row["bytes_at_bound"] else "NO",
            )
        Console(width=160).print(t)
        if engines:
            t = Table(title=f"End to end, up to the engines serving, {title}", title_justify="left")
            for col in (
                "trainer layout",
                "engine load alone (CPU s)",
                "nereus, load behind",
                "nereus, load after",
                "verl-like, load behind",
                "OpenRLHF-like, load after",
                "best peer / nereus (CPU)",
                "at most, on these cores",
            ):
                t.add_column(col, justify="right")
            for name, row in result["layouts"].items():
                t.add_row(
                    name,
                    f"{row['load'] * 1e3:.1f} ms ({row['load_cpu_s']:.3f})",
                    *(
                        f"{row[f'{way}_e2e'] * 1e3:.0f} ms ({row[f'{way}_e2e_cpu_s']:.3f})"
                        for way in ("nereus", "nereus_serial", "verl", "openrlhf")
                    ),
                    f"{row['end_to_end_ratio']:.2f}x ({row['end_to_end_cpu_ratio']:.2f}x)",
                    f"{row['end_to_end_ratio_bound']:.2f}x",
                )
            Console(width=160).print(t)
    return result
