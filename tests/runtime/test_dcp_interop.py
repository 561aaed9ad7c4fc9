"""DCP interop and DTensor views on 4 local processes (gloo), real checkpoints in a temporary directory.

One launch (``worker``) runs every reshard case and the DTensor checks: a process start costs
about a second here. The tests then read what the ranks reported and the checkpoints they left.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.tensor import Replicate, Shard

from nereus.runtime.dcp import METADATA_FILE, dcp_reshard, fqn, save
from nereus.runtime.dtensor import device_mesh, family_and_layer, placements, to_dtensor
from nereus.runtime.launch import init_from_env, run_local
from nereus.runtime.state import (
    ShardSpec,
    StateKey,
    cut,
    full_tensor,
    plan_layout,
    synthetic_state,
)
from nereus.testing.cases import CASES, case_module

WORLD = 4
SMALL = {"hidden": 64, "layers": 4}
# (case, plan) layouts viewed as DTensors: TP, TP x DP, PP with ZeRO-1, and a mesh on half the ranks
DTENSOR_LAYOUTS = (("tp4-tp2x2", "a"), ("tp4-tp2x2", "b"), ("dp4-dp2", "b"), ("tp4-tp2", "b"))


def _layout(m, plan):
    (layout,) = m.plans[plan].layouts.values()
    return layout


def worker(rank: int, world: int, root: str) -> dict:
    """Every case's DCP reshard A -> B, then the DTensor views; what this rank saw."""
    init_from_env(timeout=60)
    out: dict = {}
    for case in CASES:
        m = case_module(case, WORLD, **SMALL)
        a, b = plan_layout(m, "a"), plan_layout(m, "b")
        dst, written = dcp_reshard(synthetic_state(a.get(rank, [])), a, b, rank, world, os.path.join(root, case))
        specs = b.get(rank, [])
        out[case] = {
            "written": written,
            "checked": len(specs),
            "bad": [str(s.key) for s in specs if not torch.equal(dst[s.key], cut(full_tensor(s), s.box))],
        }
    for case, plan in DTENSOR_LAYOUTS:
        m = case_module(case, WORLD, **SMALL)
        layout, model = _layout(m, plan), m.models["actor"]
        mesh = device_mesh(layout)  # every rank creates it, also ranks outside the layout
        checked, bad = 0, []
        for s in plan_layout(m, plan).get(rank, []):
            if placements(model, layout, family_and_layer(s.key.tensor)[0], s.key.state).placements is None:
                continue  # none in these layouts; the test below checks that every shard was viewed
            full = full_tensor(s)
            d = to_dtensor(cut(full, s.box).contiguous(), s, model, layout, mesh)
            checked += 1
            if not torch.equal(d.full_tensor(), full):
                bad.append(str(s.key))
        out[f"dtensor {case} {plan}"] = {"checked": checked, "bad": bad}
    # boxes that overlap without being equal: DCP's validation of the global plan refuses the save
    key = StateKey("m.train", "weight", "w")
    spec = ShardSpec(key, (9, 4), ((2 * rank, 2 * rank + 3), (0, 4)), torch.float32)
    try:
        save({key: torch.zeros(3, 4)}, [spec], os.path.join(root, "overlap"), rank, world)
        out["overlap"] = "saved"
    except CheckpointException as e:  # a BaseException, raised on every rank
        out["overlap"] = str(e)
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return root, run_local(worker, WORLD, str(root), timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_dcp_reshard_is_bit_exact(launched, case):
    _, results = launched
    m = case_module(case, WORLD, **SMALL)
    b = plan_layout(m, "b")
    assert [r[case]["checked"] for r in results] == [len(b.get(r, [])) for r in range(WORLD)]
    assert [r[case]["bad"] for r in results] == [[]] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_every_box_of_plan_a_once(launched, case):
    root, results = launched
    md = FileSystemReader(root / case).read_metadata()
    boxes: dict[str, set] = {}
    for specs in plan_layout(case_module(case, WORLD, **SMALL), "a").values():
        for s in specs:
            boxes.setdefault(fqn(s.key), set()).add(tuple(s.box))
    assert set(md.state_dict_metadata) == set(boxes)
    for name, stored in md.state_dict_metadata.items():
        chunks = [tuple((o, o + n) for o, n in zip(c.offsets, c.sizes)) for c in stored.chunks]
        assert sorted(chunks) == sorted(boxes[name]), name  # replicated boxes written once
    # the bytes the ranks report are the data they wrote plus the coordinator's metadata file
    data = sum(info.length for info in md.storage_data.values())
    assert sum(r[case]["written"] for r in results) == data + os.path.getsize(root / case / METADATA_FILE)


@pytest.mark.slow
def test_dtensor_views_rebuild_the_full_tensors(launched):
    _, results = launched
    for case, plan in DTENSOR_LAYOUTS:
        got = [r[f"dtensor {case} {plan}"] for r in results]
        held = plan_layout(case_module(case, WORLD, **SMALL), plan)
        assert [g["checked"] for g in got] == [len(held.get(r, [])) for r in range(WORLD)], (case, plan)
        assert [g["bad"] for g in got] == [[]] * WORLD, (case, plan)


@pytest.mark.slow
def test_overlapping_boxes_are_refused(launched):
    _, results = launched
    assert all("overlapping chunks" in r["overlap"] for r in results)


def test_placements_say_where_dtensor_cannot():
    m = case_module("tp4-tp2x2", WORLD, **SMALL)  # 16 heads, 4 K/V heads, ffn 176
    model, tp4 = m.models["actor"], _layout(m, "a")

    def on(family, state="weight", **layout):
        return placements(model, dataclasses.replace(tp4, **layout), family, state)

    assert on("self_attn.q_proj.weight", tp=8, mesh=list(range(8))).placements == (Replicate(), Shard(0))
    kv = on("self_attn.k_proj.weight", tp=8, mesh=list(range(8)))
    assert kv.placements is None and "K/V heads" in kv.reason
    # 176 rows over 6: tensor_split gives 30, 30, 29, 29, 29, 29; torch.chunk 30 x 5 and 26
    uneven = on("mlp.up_proj.weight", tp=6, mesh=list(range(6)))
    assert uneven.placements is None and "torch.chunk" in uneven.reason
    # over 3 both give 59, 59, 58
    assert on("mlp.up_proj.weight", tp=3, mesh=list(range(3))).placements == (Replicate(), Shard(0))
    zero = {"tp": 2, "dp": 2, "zero": 1}
    z = on("mlp.up_proj.weight", "exp_avg", **zero)
    assert z.placements is None and "ZeRO" in z.reason
    assert on("mlp.down_proj.weight", "exp_avg", **zero).placements == (Shard(0), Shard(1))
    assert on("mlp.up_proj.weight", "weight", **zero).placements == (Replicate(), Shard(0))
    assert on("input_layernorm.weight", "master", **zero).placements == (Shard(0), Replicate())
