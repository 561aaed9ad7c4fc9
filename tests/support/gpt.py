"""What the cost-model tests share: the A100 cluster of Megatron's runs and GPT-shaped models."""

from nereus.ir import Cluster, Link, Model, Workload

# NVIDIA A100-SXM4-80GB in DGX A100 nodes (Selene): 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e,
# 600 GB/s NVLink (300 GB/s each way), 8 x 200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU.
A100 = Cluster(
    name="a100",
    nodes=400,
    gpus_per_node=8,
    gpu_memory=80 * 2**30,
    peak_flops=312e12,
    hbm_bandwidth=2039e9,
    intra_node=Link(300e9, 2e-6),
    inter_node=Link(25e9, 5e-6),
)


def gpt(layers, hidden, heads, vocab=51200):
    """A GPT-style model: MHA, 4h plain MLP, tied embeddings."""
    return Model(
        name="gpt",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        ffn=4 * hidden,
        vocab=vocab,
        mlp="plain",
        tied_embeddings=True,
    )


def train_workload(batch, seq=2048):
    return Workload(
        name="w",
        algorithm="ppo",
        roles=[],
        global_batch=batch,
        prompt_len_mean=seq // 2,
        prompt_len_max=seq // 2,
        response_len_mean=seq - seq // 2,
        response_len_max=seq - seq // 2,
        micro_batch=1,
    )
