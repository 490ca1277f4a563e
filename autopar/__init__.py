"""autopar: automatic parallelization of PyTorch training.

``autopar.plan`` captures a training step, prices every way to run it on a cluster and solves an ILP
for the fastest plan that fits; ``autopar.autoparallelize`` runs a plan on the current process group.
"""

from .api import autoparallelize, compare, plan
from .errors import AutoparError, BadInputError, NoFeasiblePlanError, PlanFormatError, UnsupportedModelError
from .plan import Plan
from .runtime import ParallelModule

__all__ = [
    "AutoparError", "BadInputError", "NoFeasiblePlanError", "ParallelModule", "Plan", "PlanFormatError",
    "UnsupportedModelError", "autoparallelize", "compare", "plan",
]
__version__ = "0.1.0"
