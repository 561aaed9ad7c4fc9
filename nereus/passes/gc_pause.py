"""Pause CPython's cyclic garbage collector while a pass builds a large acyclic structure.

A transition of a 1,024-GPU job has ~190,000 operations, each with half a dozen lists and
dicts: well over a million new container objects. Every 700 allocations the collector runs,
and each time the heap has grown by a quarter it traverses all of it (the module's EMUs
included): measured on ``nereus bench transition``, more than half of planning time went to
collections that find no garbage, since nothing the passes build is cyclic. The collector
runs again, once, after the pass.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """Disable the cyclic collector inside the block; restore its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
