"""A tiny GRPO job for the transition property tests and the runtime tests."""

from dataclasses import replace

from nereus.ir import Cluster, Link, Model, Module, Stage, Workload

GIB = 2**30


def job(heads=4, kv=2, hidden=48, ffn=90, vocab=101, layers=5, gpus=8, per_node=4):
    """A tiny GRPO job whose dimensions do not divide evenly by TP (ffn 90, vocab 101)."""
    c = Cluster(
        name="c",
        nodes=gpus // per_node,
        gpus_per_node=per_node,
        gpu_memory=80 * GIB,
        peak_flops=1e15,
        hbm_bandwidth=3e12,
        intra_node=Link(450e9, 2e-6),
        inter_node=Link(50e9, 5e-6),
        host_link=Link(55e9, 10e-6),
        host_memory=2048 * GIB,
    )
    actor = Model(
        name="actor", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, trained=True
    )
    ref = Model(
        name="ref", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, tied_embeddings=True
    )
    w = Workload(
        name="w",
        algorithm="grpo",
        roles=["actor", "ref"],
        global_batch=8,
        group_size=2,
        prompt_len_mean=16,
        prompt_len_max=16,
        response_len_mean=16,
        response_len_max=32,
        micro_batch=1,
        stages=[
            Stage(name="generate", kind="generate", models=["actor"]),
            Stage(name="infer", kind="infer", models=["ref"]),
            Stage(name="train", kind="train", models=["actor"]),
        ],
    )
    return Module(clusters={"c": c}, models={"actor": actor, "ref": ref}, workloads={"w": w})


def moe_job(experts=8, expert_ffn=18, layers=3, dense_layers=None) -> Module:
    """``job`` with a mixture of experts as actor and reference (Qwen3-MoE names, an expert FFN
    that TP 4 splits unevenly; ``dense_layers``: that many dense first layers)."""
    m = job(layers=layers)
    for name, md in m.models.items():
        m.models[name] = replace(
            md, experts=experts, experts_per_token=2, expert_ffn=expert_ffn, qk_norm=True, dense_layers=dense_layers
        )
    return m


def parse_in_worker(text: str):
    """Parse ``text`` in a pool worker (spawned processes import this module by name)."""
    import nereus

    return nereus.parse(text, "worker.nir")


def zero3_gather(tight: bool = True) -> Module:
    """The actor's training state from ZeRO-3 over 4 GPUs (TP 1) to TP 2 x DP 2 without ZeRO, on
    other GPUs: every new shard is gathered from slices of several senders. With ``tight``, each
    GPU has just the memory plan A or plan B needs on the fullest GPU, so most of it is staged."""
    from nereus.ir import Layout, Plan
    from nereus.passes.transition.derive_emus import derive_missing_emus
    from nereus.passes.transition.holdings import state_bytes

    m = job(layers=3)

    def lay(ms, tp, dp, mesh, zero=0):
        return Layout(model_stage=ms, tp=tp, pp=1, dp=dp, layers=[(0, 2)], mesh=mesh, zero=zero)

    for name, train in (
        ("a", lay("actor.train", 1, 4, [0, 1, 2, 3], zero=3)),
        ("b", lay("actor.train", 2, 2, [2, 3, 0, 1])),
    ):
        m.plans[name] = Plan(
            name=name,
            workload="w",
            cluster="c",
            layouts={
                "actor.generate": lay("actor.generate", 4, 1, [0, 1, 2, 3]),
                "ref.infer": lay("ref.infer", 4, 1, [0, 1, 2, 3]),
                "actor.train": train,
            },
        )
    if tight:
        for p in ("a", "b"):
            derive_missing_emus(m, p)
        a, b = state_bytes(m, "a"), state_bytes(m, "b")
        m.clusters["c"].gpu_memory = max(max(a.get(g, 0), b.get(g, 0)) for g in set(a) | set(b))
    return m
