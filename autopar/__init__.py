"""autopar: automatic parallelization of PyTorch training.

``autopar.plan`` captures a training step, prices every way to run it on a cluster and solves an ILP
for the fastest plan that fits; ``autopar.autoparallelize`` runs a plan on the current process group.
``autopar.load_problem`` reads a problem saved with ``plan(..., save_problem=PATH)``, to re-solve it
(``autopar.plan(problem, cluster=...)``) or re-price a plan on another cluster (``autopar.reprice``)
without capturing again. ``autopar.save_checkpoint`` / ``autopar.load_checkpoint`` save a running plan's
model and optimizer state in a layout any other plan (another world size, pipeline or ZeRO) loads.
"""

from autopar import inspect as _inspect  # noqa: F401  (registers Plan.summary and Plan.explain)
from autopar.api import autoparallelize, compare, plan, reprice
from autopar.core.errors import AutoparError, BadInputError, NoFeasiblePlanError, PlanFormatError, UnsupportedModelError
from autopar.core.plan import Plan
from autopar.ir.problem_file import SavedProblem, load_problem
from autopar.runtime.checkpoint import (checkpoint_path, latest_checkpoint, load_checkpoint, load_full_state_dict,
                                        optimizer_state_dict, save_checkpoint, save_full_state_dict)
from autopar.runtime.parallel_module import ParallelModule

__all__ = [
    "AutoparError", "BadInputError", "NoFeasiblePlanError", "ParallelModule", "Plan", "PlanFormatError",
    "SavedProblem", "UnsupportedModelError", "autoparallelize", "checkpoint_path", "compare", "latest_checkpoint",
    "load_checkpoint", "load_full_state_dict", "load_problem", "optimizer_state_dict", "plan", "reprice",
    "save_checkpoint", "save_full_state_dict",
]
__version__ = "0.1.0"
