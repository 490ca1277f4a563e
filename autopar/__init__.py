"""autopar: automatic parallelization of PyTorch training.

``autopar.plan`` captures a training step, prices every way to run it on a cluster and solves an ILP
for the fastest plan that fits; ``autopar.autoparallelize`` runs a plan on the current process group.
``autopar.load_problem`` reads a problem saved with ``plan(..., save_problem=PATH)``, to re-solve it
(``autopar.plan(problem, cluster=...)``) or re-price a plan on another cluster (``autopar.reprice``)
without capturing again.
"""

from autopar import inspect as _inspect  # noqa: F401  (registers Plan.summary and Plan.explain)
from autopar.api import autoparallelize, compare, plan, reprice
from autopar.core.errors import AutoparError, BadInputError, NoFeasiblePlanError, PlanFormatError, UnsupportedModelError
from autopar.core.plan import Plan
from autopar.ir.problem_file import SavedProblem, load_problem
from autopar.runtime.parallel_module import ParallelModule

__all__ = [
    "AutoparError", "BadInputError", "NoFeasiblePlanError", "ParallelModule", "Plan", "PlanFormatError",
    "SavedProblem", "UnsupportedModelError", "autoparallelize", "compare", "load_problem", "plan", "reprice",
]
__version__ = "0.1.0"
