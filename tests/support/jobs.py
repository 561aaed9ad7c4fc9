"""A tiny GRPO job for the transition property tests and the runtime tests."""

from nereus.ir import Cluster, Link, Model, Module, Stage, Workload

GIB = 2**30


def job(heads=4, kv=2, hidden=48, ffn=90, vocab=101, layers=5, gpus=8, per_node=4):
    """A tiny GRPO job whose dimensions do not divide evenly by TP (ffn 90, vocab 101)."""
    c = Cluster(name="c", nodes=gpus // per_node, gpus_per_node=per_node, gpu_memory=80 * GIB, peak_flops=1e15,
                hbm_bandwidth=3e12, intra_node=Link(450e9, 2e-6), inter_node=Link(50e9, 5e-6),
                host_link=Link(55e9, 10e-6), host_memory=2048 * GIB)
    actor = Model(name="actor", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, trained=True)
    ref = Model(name="ref", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, tied_embeddings=True)
    w = Workload(name="w", algorithm="grpo", roles=["actor", "ref"], global_batch=8, group_size=2, prompt_len_mean=16,
                 prompt_len_max=16, response_len_mean=16, response_len_max=32, micro_batch=1,
                 stages=[Stage(name="generate", kind="generate", models=["actor"]),
                         Stage(name="infer", kind="infer", models=["ref"]),
                         Stage(name="train", kind="train", models=["actor"])])
    return Module(clusters={"c": c}, models={"actor": actor, "ref": ref}, workloads={"w": w})


def parse_in_worker(text: str):
    """Parse ``text`` in a pool worker (spawned processes import this module by name)."""
    import nereus

    return nereus.parse(text, "worker.nir")
