"""fmt keeps // comments with the declaration, attribute or item they annotate."""

import nereus

from ..support import EXAMPLES

GRPO = next(p for p in EXAMPLES if p.name == "grpo_7b_8gpu.nir")


def test_comments_inside_grouped_emu_survive_and_keep_grouping():
    text = GRPO.read_text().replace(
        "  shard [0, 1] gpus [1, 3, 5, 7] {", "  // second TP rank\n  shard [0, 1] gpus [1, 3, 5, 7] {  // trailing"
    )
    m = nereus.parse(text)
    assert nereus.print_ir(m) == text
    assert text.count("emu @") == 1


def test_leading_trailing_and_end_of_file_comments():
    text = (
        "// header\ncluster @c {\n  nodes = 1  // one node\n  // per node\n  gpus_per_node = 8\n"
        "  gpu_memory = 80GiB\n  peak_flops = 989TFLOPs\n  hbm_bandwidth = 3.35TB/s\n"
        "  intra_node = link(bandwidth = 450GB/s, latency = 2us)\n"
        "  inter_node = link(bandwidth = 50GB/s, latency = 5us)\n}\n\n// the end\n"
    )
    m = nereus.parse(text)
    assert nereus.print_ir(m) == text


def test_comments_do_not_affect_equality():
    a = nereus.parse(GRPO.read_text())
    b = nereus.parse("// extra\n" + GRPO.read_text())
    assert a == b
