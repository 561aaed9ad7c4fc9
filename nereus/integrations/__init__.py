"""Nereus inside a training loop: live models under PyTorch's own parallelism, moved by Nereus.

- ``hf_llama``: Hugging Face ``LlamaForCausalLM`` as an IR model, and live for a layout (TP by
  ``parallelize_module``, DP by a gradient all-reduce), trained with AdamW in fp32;
- ``state``: the adapter: the live state as the shards ``plan_layout`` names, and back;
  ``check_layout`` says where the live model cannot take a layout;
- ``reshard``: a live model and optimizer moved from plan A to plan B by ``execute``;
- ``job``: a one-model training job as an IR module;
- ``controller``: the ``Controller`` that embeds the decision core in a running job;
- ``llama_adapter``: ``LlamaAdapter``, the Controller's adapter for the live HF Llama (its
  ``move`` runs ``reshard`` on every rank); ``examples/grpo_tiny.py`` is a loop around it.

This package sits above ``nereus.runtime`` and ``nereus.control`` (docs/ARCHITECTURE.md).
Importing ``hf_llama`` needs ``transformers`` (the ``hf`` extra).
"""
