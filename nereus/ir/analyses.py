"""Analyses that travel with a module: results computed from a plan's EMUs, kept on the module
(``Module.analyses``) instead of in module-level globals.

An entry remembers the EMU objects it was computed from. EMUs are frozen (``ir/emu.py``): a pass
that changes a plan's state puts new EMUs in the module, so an entry is valid exactly while the
module holds the same objects under the same keys, and is recomputed otherwise. Nothing has to
invalidate it by hand. A deep copy of the module shares the EMUs and so the entries (a copy of
the index, the same results); a pickled module travels without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Analyses:
    """Results by (analysis name, plan), each with the EMUs it read; ``get`` recomputes a stale one."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[tuple, Any]] = {}

    def get(self, module, name: str, plan: str, compute: Callable[[list], Any]) -> Any:
        """``compute(emus)`` for the plan's EMUs (``[(key, emu), ...]`` sorted by key), or the
        result kept from the last call that read the same EMU objects."""
        for gone in [k for k in self._entries if k[1] not in module.plans]:
            del self._entries[gone]  # plans the module dropped (a committed move's plan A)
        emus = sorted((k, e) for k, e in module.emus.items() if k[0] == plan)
        kept = self._entries.get((name, plan))
        if kept is not None and len(kept[0]) == len(emus) and all(
                k == kk and e is ee for (k, e), (kk, ee) in zip(emus, kept[0])):
            return kept[1]
        result = compute(emus)
        self._entries[(name, plan)] = (tuple(emus), result)
        return result

    def __deepcopy__(self, memo) -> Analyses:
        out = Analyses()
        out._entries = dict(self._entries)  # the EMUs are shared by the copy, so the results hold for it
        return out

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entries = {}
