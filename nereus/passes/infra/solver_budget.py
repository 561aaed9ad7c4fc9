"""How long a CP-SAT search may run: seconds of wall clock, or of CP-SAT's deterministic time.

Every solve here runs one worker with a fixed seed, so a solve that ends on its own (optimal, or
infeasible) is the same on every run. One that stops at a wall-clock limit is not: under load it
stops earlier in its search, with another plan. A ``deterministic`` budget counts CP-SAT's own
deterministic time instead (``max_deterministic_time``: work units close to seconds of one core,
counted from the work done, not the clock), so the same input and seed give the same result on a
loaded machine too, at the price of a wall time that stretches with the load. The simulator and
its replays need that; an interactive user wants the wall clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Budget:
    """``seconds`` for a search that may take several solves (plan-search's caps): each solve
    gets what is left."""

    seconds: float
    deterministic: bool = False
    _spent: float = 0.0
    _start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        if self.deterministic:
            return max(self.seconds - self._spent, 0.0)
        return max(self.seconds - (time.monotonic() - self._start), 0.0)

    def limit(self, solver, floor: float = 0.01) -> None:
        """Set ``solver``'s limit to what is left (at least ``floor``)."""
        left = max(self.left(), floor)
        if self.deterministic:
            solver.parameters.max_deterministic_time = left
        else:
            solver.parameters.max_time_in_seconds = left

    def charge(self, solver) -> None:
        """Count a finished solve against the budget."""
        self._spent += solver.deterministic_time
