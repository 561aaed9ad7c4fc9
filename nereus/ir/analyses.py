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

Key = tuple  # (analysis name, the plans it reads, anything else it depends on)


class Analyses:
    """Results by (analysis name, plans, other inputs), each with the EMUs of those plans it
    read; ``get`` recomputes a stale one, ``put`` records one that another pass computed."""

    def __init__(self) -> None:
        self._entries: dict[Key, tuple[tuple, Any]] = {}

    def get(self, module, name: str, plan: str, compute: Callable[[list], Any]) -> Any:
        """``compute(emus)`` for the plan's EMUs (``[(key, emu), ...]`` sorted by key), or the
        result kept from the last call that read the same EMU objects."""
        key = (name, (plan,), None)
        emus = _emus(module, (plan,))
        kept = self._valid(module, key, emus)
        if kept is not None:
            return kept[1]
        result = compute(emus)
        self._entries[key] = (tuple(emus), result)
        return result

    def put(self, module, name: str, plans: tuple[str, ...], extra: Any, result: Any) -> None:
        """Record ``result`` of analysis ``name`` over ``plans`` (and ``extra``) for their EMUs now."""
        self._entries[(name, plans, extra)] = (tuple(_emus(module, plans)), result)

    def find(self, module, name: str, plans: tuple[str, ...], extra: Any) -> Any | None:
        """The result ``put`` recorded for the same EMU objects, or None."""
        key = (name, plans, extra)
        kept = self._valid(module, key, _emus(module, plans))
        return None if kept is None else kept[1]

    def _valid(self, module, key: Key, emus: list):
        for gone in [k for k in self._entries if any(p not in module.plans for p in k[1])]:
            del self._entries[gone]  # plans the module dropped (a committed move's plan A)
        kept = self._entries.get(key)
        if (
            kept is not None
            and len(kept[0]) == len(emus)
            and all(k == kk and e is ee for (k, e), (kk, ee) in zip(emus, kept[0]))
        ):
            return kept
        return None

    def __deepcopy__(self, memo) -> Analyses:
        out = Analyses()
        out._entries = dict(self._entries)  # the EMUs are shared by the copy, so the results hold for it
        return out

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entries = {}


def _emus(module, plans: tuple[str, ...]) -> list:
    return sorted((k, e) for k, e in module.emus.items() if k[0] in plans)
