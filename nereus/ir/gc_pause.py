"""Pause CPython's cyclic garbage collector while a large acyclic structure is built.

Parsing a large file, planning a 1,024-GPU transition (~190,000 operations) and lowering it all
allocate millions of small containers that stay alive and form no cycles. The collector runs
every 700 allocations and, each time the heap has grown by a quarter, traverses all of it:
measured, that was half of a 10 MB parse, more than half of transition planning (``nereus bench
transition``) and 40% of a 32-GPU lowering, collections that found no garbage. The collector
resumes when the outermost paused block ends (blocks nest, and threads may pause at once).

On resuming, what is alive is moved to the oldest generation, where only full collections
look: ``gc.freeze()`` then ``gc.unfreeze()``, which move whole generations at once (documented:
frozen objects go back into the oldest generation). Everything a paused block built is young to
the collector, so its first young collection after the pause would traverse all of it (after
the step-933 move of combined, 622,132 operations and their lists and boxes: 1.6 s), and a
middle one again. Cyclic garbage among them waits for the next full collection instead. Skipped
where the process keeps objects frozen itself (``gc.get_freeze_count()``): unfreezing would
hand its objects back to the collector.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # paused blocks running (nested, or in several threads)
_was_enabled = True


@contextmanager
def gc_paused():
    """Disable the cyclic collector inside the block; restore its state when the last block ends."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                if not gc.get_freeze_count():
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
