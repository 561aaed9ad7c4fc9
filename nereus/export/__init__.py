"""``nereus export``: a plan's layouts as the configuration of the frameworks people run.

Targets (``export_plan(module, plan, target)``):

- ``verl`` (``verl.py``): a YAML fragment of verl 0.9.1's trainer config
  (``verl/trainer/config/ppo_megatron_trainer.yaml`` and ``ppo_trainer.yaml``): GPUs, batch sizes
  (or dynamic token budgets), steps, the vLLM rollout, the KL options that make verl create the
  reference model, and per role (actor, ref, critic) its Megatron parallel sizes when a trained
  layout uses TP or PP, otherwise its FSDP keys; the reward model as verl's ``reward.reward_model``
  inference server. ``verl-overrides``: the same as Hydra ``key=value`` lines for
  ``python -m verl.trainer.main_ppo`` (``+key=value`` for keys verl's config leaves open).
- ``megatron`` (``megatron.py``): Megatron-LM arguments (``pretrain_gpt.py``) per trained
  model-stage, as bash arrays, with the environment each launch needs.
- ``vllm`` (``vllm.py``): per generating model-stage, ``vllm.LLM`` / ``vllm.EngineArgs`` keyword arguments
  (a Python dict), the number of engine instances (the layout's DP) and ``vllm serve`` flags.

Every value carries a comment naming the layout (or workload / cluster attribute) it came from.
Whatever the framework cannot express is a line ``# not expressible in verl|Megatron-LM|vLLM: ...``,
never dropped. Units: batch sizes in samples (sequences) unless said to be prompts; lengths in
tokens; memory as the fraction of a GPU's memory vLLM takes (``gpu_memory_utilization``).
"""

from __future__ import annotations

from ..ir import Module, Plan
from .common import generate_memory
from .megatron import megatron_lines
from .verl import verl_lines
from .vllm import vllm_engine_args, vllm_lines

TARGETS = ("verl", "verl-overrides", "megatron", "vllm")
__all__ = ["TARGETS", "export_plan", "generate_memory", "vllm_engine_args"]


def export_plan(module: Module, plan_name: str, target: str) -> str:
    """The text of ``plan_name`` (with or without ``@``) for ``target`` (one of ``TARGETS``)."""
    if target not in TARGETS:
        raise ValueError(f"unknown export target '{target}'; targets: {', '.join(TARGETS)}")
    name = plan_name.lstrip("@")
    plan = module.plans.get(name)
    if plan is None:
        from ..passes.infra.pass_manager import no_such

        raise no_such(module, "export", "plan", name)
    render = {"verl": verl_lines, "verl-overrides": verl_lines, "megatron": megatron_lines, "vllm": vllm_lines}
    body = render[target](module, plan, target)
    at = 2 + len(plan.layouts)  # after the header's lines (``common.header``)
    return "\n".join(body[:at] + as_run(module, plan, target) + body[at:]) + "\n"


def as_run(module: Module, plan: Plan, target: str) -> list[str]:
    """Comment lines: the step time and memory of what the framework really runs of ``plan``,
    and ``# warning:`` lines where that differs from the plan (``passes.search.targets``)."""
    if target not in ("verl", "verl-overrides", "megatron"):
        return []
    from ..passes.search.targets import run_report

    lines, warnings = run_report(module, plan, target.partition("-")[0])
    return [f"# {x}" for x in lines] + [f"# warning: {x}" for x in warnings]
