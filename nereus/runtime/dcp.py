"""PyTorch Distributed Checkpoint (DCP) interop: save one layout's shards, load them into another's.

A DCP checkpoint records, for every tensor (its FQN), the global size and the chunks that were
written (``ChunkStorageMetadata(offsets, sizes)``); loading intersects the chunks a rank asks
for with the stored ones and reads only the stored chunks that overlap. A ``ShardSpec.box`` is
an arbitrary rectangle of the full tensor, so what matters is how a rank's box reaches DCP as a
chunk. Torch 2.13 offers three ways:

- ``DTensor``: DCP derives the chunk from the placements (``Shard(dim)`` with ``torch.chunk``'s
  rule, ``Replicate``). It cannot say ``tensor_split``'s uneven rule, K/V heads replicated over
  TP ranks or ZeRO's DP split inside a TP shard (``nereus.runtime.dtensor`` says which layouts
  it can say).
- ``ShardedTensor`` from local shards with ``ShardMetadata(offsets, sizes)``: any box, but the
  class is deprecated ("Please use DTensor instead"; its ops warn with ``FutureWarning``).
- A planner: ``SavePlanner``/``LoadPlanner`` are DCP's documented extension point. On save we
  emit one ``WriteItem`` per local tensor (type ``SHARD``, ``TensorWriteData`` with the box as
  ``ChunkStorageMetadata`` and the full shape as ``size``); on load we ask the public
  ``create_read_items_for_chunk_list`` for the reads that fill the local box.

We use the planners (subclasses of the default ones, which keep DCP's global planning): any box
works, local tensors stay plain tensors (no wrapper; DCP writes them as they are and copies read
chunks straight into the destination tensors), and nothing deprecated or private is touched.

Replicas: DCP's default global save plan dedups write items with the same (FQN, offsets) over
all ranks, whatever their type (``dedup_save_plans``; the rank with the fewest planned bytes so
far keeps it), so a box held by several ranks (DP replicas, norms on every TP rank, replicated
K/V heads) is written once. It then validates that every tensor's chunks are in bounds, do not
overlap and (when more than one rank saves) cover the tensor: boxes that overlap without being
equal fail the save. ``load`` checks that the stored chunks cover each box it asks for.

Storage: ``FileSystemWriter`` with one file per rank and DCP's default ``torch.save`` format
(each chunk a small zip record: about 1.2 KB of overhead per chunk). The writer clones a tensor
that views a larger storage (``torch.save`` would write all of it): pass compact tensors.
``FileSystemReader`` deserializes every stored chunk that a read touches whole, then narrows
it: a destination box that needs half of a stored chunk reads all of it.

Errors: DCP raises ``CheckpointException``, a ``BaseException`` (not an ``Exception``), on every
rank, carrying each failing rank's traceback.

FQNs are ``str(StateKey)``: ``actor.train:weight:layers.3.mlp.up_proj.weight``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from .state import LocalState, ShardSpec, StateKey, torch_dtype

Box = tuple[tuple[int, int], ...]  # half-open spans of every dimension (ir.emu.Box)

METADATA_FILE = ".metadata"  # what FileSystemWriter's coordinator writes next to the data files


def fqn(key: StateKey) -> str:
    """The checkpoint's name of a state tensor."""
    return str(key)


def _chunk(spec: ShardSpec) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(lo for lo, _ in spec.box), sizes=torch.Size(spec.local_shape))


class BoxSavePlanner(dcp.DefaultSavePlanner):
    """Writes every local tensor as the chunk ``spec.box`` of a tensor of ``spec.shape``."""

    def __init__(self, specs: Mapping[str, ShardSpec]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.specs = specs

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, tensor in self.state_dict.items():
            spec = self.specs[name]
            if tuple(tensor.shape) != spec.local_shape:
                raise ValueError(f"{name}: local tensor {tuple(tensor.shape)} does not fill its box {spec.box}")
            chunk = _chunk(spec)
            items.append(
                WriteItem(
                    index=MetadataIndex(name, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, size=torch.Size(spec.shape), properties=TensorProperties.create_from_tensor(tensor)
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # one chunk per FQN on a rank: the offsets name it


class BoxLoadPlanner(dcp.DefaultLoadPlanner):
    """Fills every local tensor with the box ``spec.box`` of the checkpoint's tensor, from the overlapping chunks."""

    def __init__(self, specs: Mapping[str, ShardSpec]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.specs = specs

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        reads = []
        for name in self.state_dict:
            spec = self.specs[name]
            if name not in stored:
                raise KeyError(f"{name} is not in the checkpoint")
            if tuple(stored[name].size) != spec.shape:
                raise ValueError(
                    f"{name}: checkpoint holds shape {tuple(stored[name].size)}, the plan wants {spec.shape}"
                )
            items = create_read_items_for_chunk_list(name, stored[name], [_chunk(spec)])
            # stored chunks are disjoint (validated on save): the reads fill the box iff their volumes add up
            if sum(math.prod(r.lengths) for r in items) != spec.numel:
                raise ValueError(f"{name}: the checkpoint does not cover the box {spec.box}")
            reads += items
        return LoadPlan(reads)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def save(
    state: LocalState,
    specs: list[ShardSpec],
    path: str | os.PathLike,
    rank: int,
    world: int,
    thread_count: int = 1,
    sync_files: bool = True,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Save this rank's shards into the DCP checkpoint at ``path``; the bytes this rank wrote.

    Collective over ``group`` (None: the default process group; ``rank`` and ``world`` are its):
    every rank calls it, ranks holding nothing with empty ``state`` and ``specs``.
    ``thread_count`` writer threads (one file each); ``sync_files`` fsyncs them (DCP's default).
    """
    _check_world(rank, world, group)
    by_name = {fqn(s.key): s for s in specs}
    sd = {fqn(s.key): state[s.key] for s in specs}
    planner = BoxSavePlanner(by_name)
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=thread_count, sync_files=sync_files)
    metadata = dcp.save(sd, storage_writer=writer, planner=planner, process_group=group)
    # planner.plan is this rank's final plan, after the coordinator's dedup
    written = sum(metadata.storage_data[item.index].length for item in planner.plan.items)
    if rank == 0:  # the coordinator also wrote the metadata file
        written += os.path.getsize(os.path.join(path, METADATA_FILE))
    return written


def load(
    path: str | os.PathLike, specs: list[ShardSpec], rank: int, world: int, group: dist.ProcessGroup | None = None
) -> LocalState:
    """This rank's shards under ``specs``, read from the DCP checkpoint at ``path`` (saved under any layout).

    Collective over ``group`` (None: the default process group), like ``save``. Each box is allocated once and
    DCP copies the overlapping parts of the stored chunks into it; a stored dtype other than
    ``spec.dtype`` is cast by that copy.
    """
    _check_world(rank, world, group)
    state = {s.key: torch.empty(s.local_shape, dtype=torch_dtype(s.dtype)) for s in specs}
    sd = {fqn(s.key): state[s.key] for s in specs}
    planner = BoxLoadPlanner({fqn(s.key): s for s in specs})
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=planner, process_group=group)
    return state


def uncovered(box: Box, others: list[Box]) -> list[Box]:
    """The parts of ``box`` that no box of ``others`` covers, as boxes: the cells of the grid that
    every box's edges cut ``box`` into, those outside every other box (adjacent cells along the
    first dimension merged)."""
    inside = [o for o in others if all(lo < ohi and olo < hi for (lo, hi), (olo, ohi) in zip(box, o))]
    cuts = []
    for d, (lo, hi) in enumerate(box):
        edges = {lo, hi} | {e for o in inside for e in o[d] if lo < e < hi}
        cuts.append(sorted(edges))
    cells: list[Box] = [()]
    for edges in cuts:
        cells = [c + ((a, b),) for c in cells for a, b in zip(edges, edges[1:])]
    lost = [
        c for c in cells if not any(all(olo <= lo and hi <= ohi for (lo, hi), (olo, ohi) in zip(c, o)) for o in inside)
    ]
    merged: list[Box] = []
    for c in lost:  # cells come in order of the first dimension last-varying: merge runs along dim 0
        for i, m in enumerate(merged):
            if m[1:] == c[1:] and m[0][1] == c[0][0]:
                merged[i] = ((m[0][0], c[0][1]),) + m[1:]
                break
        else:
            merged.append(c)
    return merged


def restore_lost(
    path: str | os.PathLike,
    state: LocalState,
    specs: list[ShardSpec],
    held: list[ShardSpec],
    group: dist.ProcessGroup | None = None,
) -> dict[str, int]:
    """Fill, in ``state``, the parts of this rank's plan-B shards (``specs``) that no surviving
    GPU's plan-A shard covers (``held``: every survivor's plan-A shards) from the DCP checkpoint
    at ``path``, saved under any layout; leaves every other byte as it is (moved from live
    memory). Collective over ``group`` (None: the default group): every rank calls it, with something to read or
    not (one DCP load per round; a shard missing several boxes takes several rounds). Returns
    the bytes read, by FQN."""
    by_key: dict = {}
    for h in held:
        by_key.setdefault(h.key, []).append(h.box)
    reads: list[list[tuple[ShardSpec, ShardSpec]]] = []  # rounds of (part to read, the shard it lands in)
    for s in specs:
        for i, part in enumerate(uncovered(s.box, by_key.get(s.key, []))):
            while len(reads) <= i:
                reads.append([])
            reads[i].append((ShardSpec(s.key, s.shape, part, s.dtype), s))
    rounds = torch.tensor([len(reads)])
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)
    read: dict[str, int] = {}
    for i in range(int(rounds)):
        todo = reads[i] if i < len(reads) else []
        got = load(path, [part for part, _ in todo], dist.get_rank(group), dist.get_world_size(group), group)
        for part, s in todo:
            region = tuple(slice(lo - slo, hi - slo) for (lo, hi), (slo, _) in zip(part.box, s.box))
            state[s.key][region].copy_(got[part.key])
            read[fqn(s.key)] = read.get(fqn(s.key), 0) + part.nbytes
    return read


def dcp_reshard(
    src: LocalState,
    src_layout: Mapping[int, list[ShardSpec]],
    dst_layout: Mapping[int, list[ShardSpec]],
    rank: int,
    world: int,
    path: str | os.PathLike,
    thread_count: int = 1,
    sync_files: bool = True,
) -> tuple[LocalState, int]:
    """Reshard through storage: save ``src`` under ``src_layout``, load this rank's boxes of ``dst_layout``.

    The layouts are ``plan_layout``'s maps (GPU = rank -> shards); a rank missing from one holds
    nothing there. Returns this rank's destination state and the bytes it wrote to ``path``
    (data file plus, on rank 0, the metadata file).
    """
    written = save(src, src_layout.get(rank, []), path, rank, world, thread_count, sync_files)
    # dcp.save ends with a collective after the coordinator has written the metadata, so every
    # file is in place here; the barrier only makes the two phases explicit (and timeable).
    dist.barrier()
    return load(path, dst_layout.get(rank, []), rank, world), written


def _check_world(rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    if not dist.is_initialized():
        raise RuntimeError("DCP save/load here is collective: join the process group first (launch.init_from_env)")
    said = (dist.get_rank(group), dist.get_world_size(group))
    if said != (rank, world):
        raise ValueError(f"rank {rank} of {world} given, the process group says {said[0]} of {said[1]}")
