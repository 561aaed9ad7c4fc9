"""Workers for test_embedding_doc.py (importable: run_local spawns fresh processes)."""

from __future__ import annotations


def run_doc_loop(rank: int, world: int, code: str) -> dict:
    """Run the loop of docs/embedding.md as a script would (``__main__``) on this rank."""
    ns: dict = {"__name__": "__main__"}
    exec(compile(code, "docs/embedding.md", "exec"), ns)  # noqa: S102 - the repository's own doc
    ctl = ns["ctl"]
    return {"losses": ns["losses"], "plan": ctl.plan, "action": ctl.last.action, "active": ctl.active}


class _Still:
    """An adapter for a controller that is never asked to move."""

    def export(self):
        raise AssertionError("not moved")

    def load(self, module, plan, state):
        raise AssertionError("not moved")


def stage_names(rank: int, world: int) -> dict:
    """``ctl.stage`` with a name that is no model-stage of the running plan, and with one that is."""
    from transformers import LlamaConfig

    from nereus.integrations.controller import Controller
    from nereus.integrations.hf_llama import ir_model
    from nereus.integrations.job import layout, training_job
    from nereus.runtime.launch import init_from_env

    init_from_env(timeout=30)
    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = ir_model(cfg, "actor")
    module = training_job(model, {"a": layout(model)}, world)
    ctl = Controller(module, "@a", _Still(), show=False)  # "@a" from Python: the plan is "a"
    out: dict = {"plan": ctl.plan}
    try:
        with ctl.stage("actor.generate"):
            out["entered"] = True  # must not be reached: the name is checked on entry
    except ValueError as e:
        out["error"] = str(e)
    with ctl.stage("actor.train"):
        pass
    out["timed"] = sorted(ctl._seconds)
    return out
