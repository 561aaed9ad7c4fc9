"""``Candidates.of_layout``: which of a layout's process groups span nodes (the links its TP,
PP, DP and CP traffic take), against the groups written out GPU by GPU through ``Layout.gpu``."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.ir import Layout
from nereus.passes.cost.cost_model import NIC, NVLINK, Candidates

from ..support.jobs import job


def links_by_groups(cluster, lay: Layout) -> dict[str, int]:
    def spans(groups):
        return NIC if any(len({cluster.node_of(g) for g in grp}) > 1 for grp in groups) else NVLINK

    coords = list(lay.coords())
    return {
        "tp": spans([[lay.gpu(d, p, t) for t in range(lay.tp)] for d in range(lay.replicas) for p in range(lay.pp)]),
        "pp": spans([[lay.gpu(d, p, t), lay.gpu(d, p + 1, t)] for d, p, t in coords if p + 1 < lay.pp]),
        "dp": spans([[lay.gpu(d, p, t) for d in range(lay.replicas)] for p in range(lay.pp) for t in range(lay.tp)]),
        "cp": spans(
            [
                [lay.gpu(d * lay.cp + c, p, t) for c in range(lay.cp)]
                for d in range(lay.dp)
                for p in range(lay.pp)
                for t in range(lay.tp)
            ]
        ),
    }


@st.composite
def layouts(draw):
    tp, pp, dp, cp = (draw(st.sampled_from([1, 2, 4])) for _ in range(4))
    per_node = draw(st.sampled_from([2, 4, 8]))
    world = tp * pp * dp * cp
    nodes = -(-world // per_node) + draw(st.integers(0, 2))
    mesh = draw(st.permutations(range(nodes * per_node)))[:world]
    m = job(gpus=nodes * per_node, per_node=per_node)
    lay = Layout(model_stage="actor.train", tp=tp, pp=pp, dp=dp, cp=cp, layers=[(0, 4)] * pp, mesh=list(mesh))
    return m.clusters["c"], lay


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_links_are_those_of_the_groups_written_out(case):
    cluster, lay = case
    c = Candidates.of_layout(cluster, lay)
    got = {"tp": int(c.tp_link[0]), "pp": int(c.pp_link[0]), "dp": int(c.dp_link[0]), "cp": int(c.cp_link[0])}
    assert got == links_by_groups(cluster, lay)
