"""Train a built-in model k steps under a plan on gloo ranks and, beside it, in one process.

This is how autopar proves a plan is numerically faithful (docs/architecture.md "Correctness"): same seed, same global
batches, AdamW, per-step losses and gathered final parameters compared. ``autopar demo`` and the
multi-process tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from autopar.api import autoparallelize
from autopar.core.plan import Plan
from autopar.testing.launch import run_on_ranks
from autopar.models import ModelBundle, build_model

LR = 1e-4
"""AdamW learning rate of parity runs. Adam normalizes each element's update, so rounding differences
in near-zero gradients (the reduction order changes with the batch split) can move an element by a
fraction of ``lr`` per step; at 1e-4 three steps stay inside docs/architecture.md's atol of 1e-5. Gradients
themselves are compared separately (``grads=True``)."""


@dataclass
class TrainResult:
    losses: list[float]
    params: dict[str, torch.Tensor]


def batches(bundle: ModelBundle, steps: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` global batches shaped like the bundle's example batch, from a seeded generator."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        out.append(tuple(_like(t, g, bundle) for t in (*bundle.example_inputs, bundle.example_targets)
                         if t is not None))
    return out


def _like(t: torch.Tensor, g: torch.Generator, bundle: ModelBundle) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, generator=g, dtype=t.dtype)
    high = int(getattr(bundle.config, "vocab", 2))
    return torch.randint(0, high, t.shape, generator=g, dtype=t.dtype)


def build(name: str, overrides: Mapping[str, Any] | None, global_batch: int, seq: int | None, seed: int) -> ModelBundle:
    return build_model(name, overrides=overrides, global_batch=global_batch, seq=seq, device="cpu", seed=seed)


OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
"""AdamW is what people train with; SGD's update is proportional to the gradient, so a parity run with
it also catches a gradient that is off by a constant factor (which Adam's normalization hides)."""


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    return OPTIMIZERS[kind](params, lr=LR if kind == "adamw" else 0.1)


def train_single(name: str, overrides: Mapping[str, Any] | None, global_batch: int, seq: int | None,
                 steps: int, seed: int = 0, optimizer: str = "adamw") -> TrainResult:
    bundle = build(name, overrides, global_batch, seq, seed)
    model, loss_fn = bundle.model, bundle.loss_fn
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for *inputs, targets in batches(bundle, steps, seed):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return TrainResult(losses, {k: v.detach().clone() for k, v in model.named_parameters()})


def train_parallel_rank(rank: int, world: int, name: str, overrides: Mapping[str, Any] | None,
                        global_batch: int, seq: int | None, steps: int, plan: dict | None,
                        constraints: Mapping[str, Any] | None, seed: int = 0,
                        optimizer: str = "adamw") -> dict[str, Any]:
    """One rank's training under ``plan`` (or a plan made here for this world); rank 0 returns results."""
    bundle = build(name, overrides, global_batch, seq, seed)
    pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                 example_targets=bundle.example_targets, constraints=constraints,
                                 plan=Plan.from_dict(plan) if plan else None)
    opt = make_optimizer(optimizer, pm.parameters())
    losses = []
    for batch in batches(bundle, steps, seed):
        opt.zero_grad()
        losses.append(pm.step(*batch).item())
        opt.step()
    state = pm.full_state_dict()
    return {"losses": losses, "params": state if rank == 0 else None, "plan": pm.plan.to_dict(),
            "redistributes": pm.redistributes}


def train_parallel(world: int, name: str, overrides: Mapping[str, Any] | None, global_batch: int,
                   seq: int | None, steps: int, plan: dict | None = None,
                   constraints: Mapping[str, Any] | None = None, seed: int = 0,
                   optimizer: str = "adamw") -> dict[str, Any]:
    results = run_on_ranks(train_parallel_rank, world, name, overrides, global_batch, seq, steps, plan,
                           constraints, seed, optimizer)
    return {"losses": [r["losses"] for r in results], "params": results[0]["params"],
            "plan": results[0]["plan"], "redistributes": results[0]["redistributes"]}


def _train_many_rank(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_parallel_rank(rank, world, **run) for run in runs]


def train_parallel_many(world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several ``train_parallel`` runs (keyword dicts) in one set of processes: one spawn, one group."""
    per_rank = run_on_ranks(_train_many_rank, world, runs)
    return [{"losses": [r[i]["losses"] for r in per_rank], "params": per_rank[0][i]["params"],
             "plan": per_rank[0][i]["plan"], "redistributes": per_rank[0][i]["redistributes"]}
            for i in range(len(runs))]


def max_param_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)
