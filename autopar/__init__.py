"""autopar: automatic parallelization of PyTorch training.

``autopar.plan`` captures a training step, prices every way to run it on a cluster and solves an ILP
for the fastest plan that fits; ``autopar.autoparallelize`` runs a plan on the current process group.
``autopar.load_problem`` reads a problem saved with ``plan(..., save_problem=PATH)``, to re-solve it
(``autopar.plan(problem, cluster=...)``) or re-price a plan on another cluster (``autopar.reprice``)
without capturing again.
"""

from .api import autoparallelize, compare, plan
from .errors import AutoparError, BadInputError, NoFeasiblePlanError, PlanFormatError, UnsupportedModelError
from .plan import Plan
from .problem_file import SavedProblem, load_problem
from .runtime import ParallelModule
from .whatif import reprice

__all__ = [
    "AutoparError", "BadInputError", "NoFeasiblePlanError", "ParallelModule", "Plan", "PlanFormatError",
    "SavedProblem", "UnsupportedModelError", "autoparallelize", "compare", "load_problem", "plan", "reprice",
]
__version__ = "0.1.0"
