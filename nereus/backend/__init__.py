"""Nereus backend layer (docs/ARCHITECTURE.md): a scheduled transition becomes a collective program.

``shards`` is the layer's vocabulary (``StateKey``, ``ShardSpec``, ``plan_layout``), ``lower``
the lowering, ``program`` the program and its printed form (``fold``: per-layer repetition
folded into ``layers.A..B`` ranges), ``summary`` what ``nereus lower`` prints by default,
``script`` the torchrun rendition, ``lower_collectives`` the layer's pass. Importing it imports neither torch nor the
runtime.
"""
