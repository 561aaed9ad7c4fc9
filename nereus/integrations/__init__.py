"""Nereus inside a training loop: live models under PyTorch's own parallelism, moved by Nereus.

- ``hf_llama``: Hugging Face ``LlamaForCausalLM`` (and, for a value head, one-label
  ``LlamaForSequenceClassification``) as an IR model, and live for a layout (TP by
  ``parallelize_module``, DP by DDP, PP by ``torch.distributed.pipelining``), trained with AdamW
  in fp32 or frozen;
- ``llama_state``: the live state as the shards ``plan_layout`` names, and back;
  ``check_layout`` says where the live model cannot take a layout;
- ``llama_reshard``: every live model of a job moved from plan A to plan B by one ``execute``
  (``reshard_job``; ``reshard_llama`` for one model);
- ``job``: a live RL job as an IR module (``rl_job``: actor, critic, reference... one
  model-stage per live model; ``training_job``: one model);
- ``stage_data``: what one model-stage computes for another, across their layouts;
- ``controller``: the ``Controller`` that embeds the decision core in a running job;
- ``llama_adapter``: ``JobAdapter``, the Controller's adapter for a job's live HF Llamas (its
  ``move`` runs ``reshard_job`` on every rank; ``LlamaAdapter`` for one model);
  ``examples/grpo_tiny.py`` and ``examples/ppo_tiny.py`` are loops around it.

This package sits above ``nereus.runtime`` and ``nereus.control`` (docs/ARCHITECTURE.md).
Importing ``hf_llama`` needs ``transformers`` (the ``hf`` extra).
"""
