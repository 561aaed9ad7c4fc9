"""What users' tests and Nereus's own share: golden plans and resharding cases.

- ``golden``: ``// RUN:`` headers, producing and comparing golden IR (the ``nereus opt
  --golden`` command uses it);
- ``plugin``: the pytest plugin with the ``nir_golden`` fixture (installed as a ``pytest11``
  entry point; the only module here that imports pytest);
- ``cases``: the resharding cases (IR modules of plan pairs) that ``nereus bench reshard``,
  the runtime tests and users' tests run.

Importing this package imports neither pytest nor torch.
"""

from .cases import CASES, EP_CASES, case_module, job_text
from .golden import GoldenMismatch, compare, produce, run_header

__all__ = ["CASES", "EP_CASES", "GoldenMismatch", "case_module", "compare", "job_text", "produce", "run_header"]
