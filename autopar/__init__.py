"""autopar: automatic parallelization of PyTorch training.

``autopar.plan`` captures a training step, prices every way to run it on a cluster and solves an ILP
for the fastest plan that fits; ``autopar.autoparallelize`` runs a plan on the current process group.
``autopar.load_problem`` reads a problem saved with ``plan(..., save_problem=PATH)``, to re-solve it
(``autopar.plan(problem, cluster=...)``) or re-price a plan on another cluster (``autopar.reprice``)
without capturing again. ``autopar.save_checkpoint`` / ``autopar.load_checkpoint`` save a running plan's
model and optimizer state in a layout any other plan (another world size, pipeline or ZeRO) loads.
"""

import importlib

from autopar.core.collector import collector_paused

with collector_paused():  # torch, DTensor and autopar load a million objects that live as long as the process
    from autopar import inspect as _inspect  # noqa: F401  (registers Plan.summary and Plan.explain)
    from autopar.api import autoparallelize, compare, float8_eager, plan, reprice
    from autopar.core.errors import (AutoparError, BadInputError, NoFeasiblePlanError, PlanFormatError,
                                     UnsupportedModelError)
    from autopar.core.plan import Plan
    from autopar.ir.problem_file import SavedProblem, load_problem

_RUNTIME = {  # imported on first use: the runtimes pull in the rewrite passes and AOT autograd, which
    # planning, inspecting plans and re-solving saved problems do not need (a second off every command)
    "ParallelModule": "autopar.runtime.parallel_module",
    **{name: "autopar.runtime.checkpoint" for name in (
        "checkpoint_path", "latest_checkpoint", "load_checkpoint", "load_full_state_dict", "optimizer_state_dict",
        "save_checkpoint", "save_full_state_dict")},
}


def __getattr__(name: str) -> object:
    if name in _RUNTIME:
        return getattr(importlib.import_module(_RUNTIME[name]), name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")

__all__ = [
    "AutoparError", "BadInputError", "NoFeasiblePlanError", "ParallelModule", "Plan", "PlanFormatError",
    "SavedProblem", "UnsupportedModelError", "autoparallelize", "checkpoint_path", "compare", "float8_eager",
    "latest_checkpoint", "load_checkpoint", "load_full_state_dict", "load_problem", "optimizer_state_dict", "plan",
    "reprice", "save_checkpoint", "save_full_state_dict",
]
__version__ = "0.1.0"
