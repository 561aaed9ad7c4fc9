"""Benchmarks behind ``nereus bench NAME``; ``benchmarks/`` runs the same workloads under pytest-benchmark."""

from .calibrate_bench import run as _calibrate
from .controller_bench import run as _controller
from .estimate_bench import run as _estimate
from .parse_bench import run as _parse
from .plan_search_bench import run as _plan_search
from .push_bench import run as _push
from .reshard_bench import run as _reshard
from .transition_bench import run as _transition
from .validate_bench import run as _validate

BENCHMARKS = {"parse": _parse, "estimate": _estimate, "plan-search": _plan_search, "transition": _transition,
              "reshard": _reshard, "calibrate": _calibrate,
              "controller": _controller, "push": _push, "validate": _validate}
