"""Worker of ``test_trl.py``: TRL's GRPOTrainer (colocated vLLM) on a tiny Llama built from a
config, its engine synced by ``nereus.integrations.trl``; the engine's log-probabilities against
the trainer's forward pass of the weights it trained."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nereus.runtime.launch import init_from_env

PROMPTS = 16


def tiny(workdir: Path):
    """A tiny Llama and a word-level tokenizer, saved where vLLM loads them (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)} | {"<unk>": 256, "<eos>": 257, "<pad>": 258}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    cfg = LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs >= 32
        max_position_embeddings=128,
        eos_token_id=257,
        pad_token_id=258,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(workdir)
    tokenizer.save_pretrained(workdir)
    return tokenizer


def hf_logprobs(model, seqs: list[list[int]]) -> list[list[float]]:
    """The trainer's model's log-probability of every token of each sequence after the first."""
    with torch.no_grad():
        out = []
        for q in seqs:
            logits = model(torch.tensor([q])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append(lp[torch.arange(len(q) - 1), torch.tensor(q[1:])].tolist())
        return out


def engine_logprobs(llm, seqs: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": list(q)} for q in seqs], params, use_tqdm=False)
    return [[step[t].logprob for t, step in zip(q[1:], o.prompt_logprobs[1:])] for q, o in zip(seqs, outs)]


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def grpo(rank: int, world: int, workdir: str, steps: int, fsdp: bool = False) -> dict:
    """``steps`` GRPO steps with ``NereusGRPOTrainer`` (``fsdp``: under FSDP2, accelerate's); then one
    more sync and the engine scored."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    init_from_env(timeout=300)
    from datasets import Dataset
    from trl import GRPOConfig
    from trl.generation.vllm_generation import VLLMGeneration

    from nereus.integrations.trl import NereusGRPOTrainer, NereusVLLMGeneration

    where = Path(workdir) / "model"
    if rank == 0:
        tiny(where)
    torch.distributed.barrier()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(where)
    prompts = [" ".join(f"t{(i * 7 + j) % 256}" for j in range(5)) for i in range(PROMPTS)]

    def reward(completions, **_):  # longer completions score higher: something to learn
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(Path(workdir) / f"out{rank}"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=steps,
        learning_rate=1e-2,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=64,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}} if fsdp else {}),
    )
    trainer = NereusGRPOTrainer(
        model=str(where),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    gen = trainer.vllm_generation
    assert isinstance(gen, NereusVLLMGeneration)
    model = trainer.accelerator.unwrap_model(trainer.model)
    seqs = [tokenizer(p)["input_ids"] + [(3 * i + k) % 256 for k in range(6)] for i, p in enumerate(prompts[:4])]
    initial = hf_logprobs(model, seqs)
    trainer.train()
    syncs = len(gen.sync_seconds)
    trained = hf_logprobs(model, seqs)
    stale = engine_logprobs(gen.llm, seqs)  # the engine as the last step's sync left it
    gen.sync_weights()
    served = engine_logprobs(gen.llm, seqs)
    # TRL's own colocated sync on the same engine, for the record of what it does on vLLM's CPU build
    try:
        VLLMGeneration.sync_weights(gen)
        stock = "ok"
    except AttributeError as e:
        stock = f"AttributeError: {e}"
    received = gen.push_plan.stats.bytes_received if gen.push_plan else None
    gen.llm.llm_engine.engine_core.shutdown()  # before exit: its teardown destroys the default group
    return {
        "rank": rank,
        "received": received,
        "syncs": syncs,
        "planned_bytes": gen.push_plan.planned_bytes if gen.push_plan else None,
        "zero": gen.held_layout().zero,
        "engine_dtype": str(gen.llm.llm_engine.model_config.dtype),
        "served_vs_trained": gap(served, trained),
        "served_vs_initial": gap(served, initial),
        "stale_vs_trained": gap(stale, trained),
        "stock": stock,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
