"""Numerical parity: train a model k steps under a plan on gloo ranks and, beside it, in one process.

This is how autopar proves a plan numerically faithful (docs/architecture.md "Correctness"). Both runs
build the model from the same seed and feed the same global batches to plain SGD at ``LR``; the parallel
run matches when every parameter's gradient after the first backward, gathered to its full value, is
within ``GRAD_RTOL``/``GRAD_ATOL`` of single-process autograd's, every rank's per-step loss within
``LOSS_RTOL`` and every gathered final parameter within ``PARAM_ATOL``. ``ParityResult.assert_matches``
is that check: its AssertionError names, for each kind that is off, the worst tensor and its error.

SGD, not Adam: SGD's update is proportional to the gradient, so a gradient off by a constant factor moves
the parameters, where Adam's per-element normalization hides it (``LR`` states the margin). Gradients
are compared directly too, so an error shows where it starts rather than three updates later.
``train_parallel_many`` trains several runs in one spawn of ranks (spawning is most of a test's time);
``autopar demo`` and the multi-process tests use this module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.api import autoparallelize, float8_eager
from autopar.core.batch import microbatch_pieces
from autopar.core.plan import Plan
from autopar.models import ModelBundle, build_model
from autopar.testing.counters import CollectiveCounter, planned_for_dtensor
from autopar.testing.launch import run_on_ranks

LR = 0.1
"""SGD learning rate of parity runs. A gradient 1.25x too large on every parameter then moves the final
parameters of mlp, tiny-gpt and tiny-llama by 1e-3 to 3e-3 after three steps, 100x ``PARAM_ATOL`` or
more (``tests/test_parity.py`` checks 50x), while the rounding differences of another reduction order
(tiny-gpt under dp=2: gradients 1e-8 apart) leave them within 1e-8."""
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-5
PARAM_ATOL = 1e-5


@dataclass(frozen=True)
class Tolerances:
    """How far a parallel run may be from the reference: gradients (``grad_rtol``, ``grad_atol``),
    final parameters (``param_atol``) and losses (``loss_rtol``), elementwise as
    ``torch.testing.assert_close`` reads them."""

    grad_rtol: float = GRAD_RTOL
    grad_atol: float = GRAD_ATOL
    param_atol: float = PARAM_ATOL
    loss_rtol: float = LOSS_RTOL
    grad_scale_rtol: float = 0.0  # each gradient tensor's absolute tolerance at least this share of its largest entry


FP32 = Tolerances(grad_scale_rtol=1e-6)
"""A run in fp32 against the fp32 reference: what ``torch.testing.assert_close`` allows fp32, and per gradient
tensor at least a millionth of its largest entry (8 units of fp32's last place there): an entry that sums terms
as large as that entry, in another order (a batch split over ranks), rounds at their scale, so an entry that
cancels to near zero may be off by far more than ``grad_rtol`` of itself (RWKV's embedding gradient spans 0.01 to
100: under dp=2 an entry of 0.0128 was 1.5e-5 off, 1.5e-7 of the largest). A gradient 1.25x too large is still
off by 25% of its largest entries."""
BF16 = Tolerances(grad_rtol=3e-2, grad_atol=1e-3, param_atol=1e-3, loss_rtol=1.6e-2, grad_scale_rtol=3e-2)
"""A mixed-precision run against the hand-made mixed-precision reference (``train_single(dtype=...)``):
bf16 keeps 8 bits of mantissa, so a value computed in another order (a matmul split over ranks, a
sum reduced in pieces) may differ by a few units in its last place, 2**-8 of it each. Losses differ by
up to two such units (1.6e-2); gradients by 3% of themselves, or 1e-3 where they are small, or 3% of
their tensor's largest entry: a bias gradient summed over tokens rounds at the scale of its terms, so
an entry that cancels to near zero (0.0007 in a tensor reaching 0.1) may be off by two units of that
scale. A gradient 1.25x too large is still off by 25% at its largest entries, 8x their allowance
(``tests/test_mixed_precision.py`` checks that it fails). These are loose enough that an fp32 run would pass them too: that a plan
computes in bf16 is checked apart (its losses are bf16 numbers)."""

FP8 = Tolerances(grad_rtol=0.1, grad_atol=1e-3, param_atol=1e-3, loss_rtol=1.6e-2, grad_scale_rtol=0.1)
"""A float8 plan (``precision.fp8``) against one process running the same float8 linears
(``train_single(fp8=...)``): both scale by the same amaxes, but e4m3 keeps 3 bits of mantissa, so a value that
reaches a float8 cast a unit of fp32 apart (a row-split product summed in another order, under tensor
parallelism; a weight updated by gradients reduced in pieces, a step later) can round to the neighbouring
float8 value, 2**-3 of it, and carry that into what reads it: Llama and GPT with tp=2 were off by up to 7% of a
gradient tensor's largest entry after one step (GPT), or not at all (Llama); compiled by inductor, whose fused
kernels round fp32 values otherwise, tiny Llama under dp=2 was off by 5-13%. Gradients are allowed 10% of
themselves, or 10% of their tensor's largest entry; a gradient 1.25x too large is still off by 25% there
(``tests/test_float8.py`` checks that it fails)."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of parity runs: plain SGD at ``LR`` (no momentum, no weight decay)."""
    return torch.optim.SGD(params, lr=LR)


@dataclass
class TrainResult:
    """A single-process run: per-step losses, each parameter's gradient after the first backward, and
    each parameter's final value, by fully qualified name."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # final, those the step writes among them


@dataclass
class ParityResult:
    """A run on W ranks, gathered: each rank's per-step losses, each parameter's full gradient after the
    first backward, and each parameter's full final value."""

    losses: list[list[float]]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # final persistent buffers, gathered

    def mismatches(self, single: TrainResult, tol: Tolerances = FP32) -> list[str]:
        """One line per kind (gradients, parameters, buffers, losses) that differs from ``single`` beyond its
        tolerance: how many tensors are off, and the worst with its values and error. Buffers are those this run
        gathered (``pm.state_dict()``'s persistent ones), compared with the reference's of the same names."""
        expected_losses = [single.losses] * len(self.losses)
        found = [_tensors_mismatch("gradients after the first backward", self.grads, single.grads,
                                   tol.grad_rtol, tol.grad_atol, tol.grad_scale_rtol),
                 _tensors_mismatch("final parameters", self.params, single.params, 0.0, tol.param_atol),
                 _tensors_mismatch("final buffers", self.buffers, {k: single.buffers[k] for k in self.buffers},
                                   0.0, tol.param_atol),
                 _tensors_mismatch("per-step losses", _per_step(self.losses), _per_step(expected_losses),
                                   tol.loss_rtol, 0.0)]
        return [line for line in found if line]

    @property
    def tolerances(self) -> Tolerances:
        """The tolerances this run is held to (``FP32``; a mixed-precision run's: ``BF16``)."""
        return FP32

    def assert_matches(self, single: TrainResult, what: str = "the parallel run") -> None:
        """Raise an AssertionError listing ``mismatches(single)``, if there are any, for ``what``."""
        found = self.mismatches(single, self.tolerances)
        if found:
            raise AssertionError(f"{what} differs from single-process training:\n  " + "\n  ".join(found))


@dataclass
class AutoparResult(ParityResult):
    """A ``ParityResult`` of autopar's runtime, with the plan it ran and its redistribute count."""

    plan: dict[str, Any] = field(default_factory=dict)
    redistributes: int = 0
    lowered: dict[str, Any] = field(default_factory=dict)  # of a lowered run: its programs, and why any fell back

    @property
    def tolerances(self) -> Tolerances:
        """``FP8`` for a float8 plan (``precision.fp8``), else ``BF16`` when it computes in 16 bits
        (``precision.compute``), else ``FP32``."""
        precision = self.plan.get("precision", {})
        if precision.get("fp8"):
            return FP8
        return FP32 if precision.get("compute", "fp32") == "fp32" else BF16

    def assert_matches(self, single: TrainResult, what: str = "") -> None:
        """As ``ParityResult.assert_matches``; the message names the plan's model and degrees."""
        degrees = {k: v for k, v in self.plan["degrees"].items() if v > 1}
        super().assert_matches(single, what or f"{self.plan['model']['name']} under {degrees}")

    @classmethod
    def from_ranks(cls, per_rank: list[Mapping[str, Any]]) -> AutoparResult:
        """From what each rank returned (``train_module``'s dict; rank 0's holds the gathered tensors)."""
        first = per_rank[0]
        return cls(losses=[r["losses"] for r in per_rank], grads=first["grads"], params=first["params"],
                   buffers=first.get("buffers") or {}, plan=first["plan"], redistributes=first["redistributes"],
                   lowered=first.get("lowered", {}))


def _per_step(losses_per_rank: list[list[float]]) -> dict[str, torch.Tensor]:
    """Each rank's loss at each step as a named scalar, to compare like tensors."""
    return {f"rank {r} step {s}": torch.tensor(loss, dtype=torch.float64)
            for r, losses in enumerate(losses_per_rank) for s, loss in enumerate(losses)}


@dataclass
class _Error:
    """The worst element of one tensor compared with its expected value."""

    excess: float  # |diff| / allowed at the worst element (inf for a shape mismatch or NaN)
    text: str


def _tensors_mismatch(kind: str, got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                      rtol: float, atol: float, scale_rtol: float = 0.0) -> str | None:
    """``None`` if every tensor of ``got`` is within ``atol + rtol * |expected|`` elementwise (the rule of
    ``torch.testing.assert_close``), ``atol`` raised per tensor to ``scale_rtol`` of its largest expected
    entry, else a line naming how many are off and the worst."""
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or unexpected:
        return f"{kind}: names differ, missing {missing}, unexpected {unexpected}"
    errors = {name: _error(got[name], expected[name], rtol, max(atol, scale_rtol * _largest(expected[name])))
              for name in expected}
    off = {name: e for name, e in errors.items() if e.excess > 1}
    if not off:
        return None
    worst = max(off, key=lambda name: off[name].excess)
    return f"{kind}: {len(off)} of {len(errors)} off, worst {worst}{off[worst].text}"


def _largest(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _error(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> _Error:
    if got.shape != expected.shape:
        return _Error(float("inf"), f": shape {list(got.shape)}, expected {list(expected.shape)}")
    got, expected = got.detach().double(), expected.detach().double()
    diff = (got - expected).abs()
    allowed = atol + rtol * expected.abs()
    excess = torch.where(diff == 0, 0.0, diff / allowed).nan_to_num(nan=float("inf")).reshape(-1)
    if excess.numel() == 0:
        return _Error(0.0, "")
    i = int(excess.argmax())
    index = list(torch.unravel_index(torch.tensor(i), got.shape)) if got.dim() else []
    at = f"[{', '.join(str(int(j)) for j in index)}]" if index else ""
    value, want = got.reshape(-1)[i].item(), expected.reshape(-1)[i].item()
    return _Error(float(excess[i]), f"{at}: {value:.6g}, expected {want:.6g} "
                                    f"(|diff| {abs(value - want):.3g}, allowed {float(allowed.reshape(-1)[i]):.3g})")


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest elementwise difference between same-named tensors (``autopar demo`` prints it)."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- the runs ---------------------------------------------------------------------------------------
def batches(bundle: ModelBundle, steps: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` global batches shaped like the bundle's example batch, from a seeded generator: drawn by
    the model's ``random_batch(generator, example_batch)`` where it has one (``models/hf.py``'s
    ``HFModel``, whose inputs include attention masks and class ids of its own range), else floats from
    a standard normal and integers below the config's ``vocab``."""
    g = torch.Generator().manual_seed(seed + 1)
    like = tuple(t for t in (*bundle.example_inputs, bundle.example_targets) if t is not None)
    draw = getattr(bundle.model, "random_batch", None)
    if draw is not None:
        return [draw(g, like) for _ in range(steps)]
    return [tuple(_like(t, g, bundle) for t in like) for _ in range(steps)]


def _like(t: torch.Tensor, g: torch.Generator, bundle: ModelBundle) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, generator=g, dtype=t.dtype)
    high = int(getattr(bundle.config, "vocab", 2))
    return torch.randint(0, high, t.shape, generator=g, dtype=t.dtype)


def build(name: str, overrides: Mapping[str, Any] | None, global_batch: int, seq: int | None, seed: int) -> ModelBundle:
    return build_model(name, overrides=overrides, global_batch=global_batch, seq=seq, device="cpu", seed=seed)


def train_single(name: str, overrides: Mapping[str, Any] | None, global_batch: int, seq: int | None,
                 steps: int, seed: int = 0, optimizer: OptimizerFactory = sgd, dtype: str | None = None,
                 clip: tuple[float, float] | None = None, autocast: torch.dtype | None = None,
                 microbatches: int = 1, fp8: str | None = None) -> TrainResult:
    """The reference: ``steps`` steps of single-process autograd (``optimizer``: parity's SGD unless a
    test of something else, such as the example script, trains with another). With ``dtype`` (bf16,
    fp16), mixed precision done by hand: the optimizer steps the model's fp32 parameters, each step
    runs the model on copies of them, its buffers and its float inputs in ``dtype``. With ``clip``
    (max_norm, norm_type), each backward's gradients are clipped by ``torch.nn.utils.clip_grad_norm_``. With
    ``autocast``, each forward and loss runs under eager ``torch.autocast`` on the CPU in that dtype. With
    ``microbatches`` m, eager gradient accumulation: each batch cut into m pieces (the inputs that carry it, on
    dim 0), run one after the other (a model that normalizes over its batch, BatchNorm, sees each piece's
    statistics), each piece's loss weighted 1/m (a mean loss over pieces of equal counts). With ``fp8`` (a
    ``core.plan.FP8_RECIPES`` name), the linear layers a float8 plan runs in float8 (``ir/float8.py``) run so
    in eager PyTorch too (``autopar.api.float8_eager``)."""
    bundle = build(name, overrides, global_batch, seq, seed)
    model, loss_fn = bundle.model, bundle.loss_fn
    if fp8 is not None:
        float8_eager(model, bundle.example_inputs, loss_fn, example_targets=bundle.example_targets)
    opt = optimizer(model.parameters())
    losses, grads = [], {}
    for i, batch in enumerate(batches(bundle, steps, seed)):
        opt.zero_grad()
        loss = torch.zeros(())
        for piece in microbatch_pieces(batch, microbatches):
            inputs, targets = (piece[:-1], piece[-1]) if bundle.example_targets is not None else (piece, None)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                part = _reference_loss(model, loss_fn, inputs, targets, dtype) / microbatches
            part.backward()
            loss = loss + part.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)
        if i == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return TrainResult(losses, grads, {k: v.detach().clone() for k, v in model.named_parameters()},
                       {k: v.detach().clone() for k, v in model.named_buffers()})


def _reference_loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                    targets: torch.Tensor | None, dtype: str | None) -> torch.Tensor:
    if dtype is None or dtype == "fp32":
        return loss_fn(model(*inputs), targets)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cast = lambda t: t.to(compute) if t is not None and t.is_floating_point() else t  # noqa: E731
    state = {**{n: cast(p) for n, p in model.named_parameters()}, **{n: cast(b) for n, b in model.named_buffers()}}
    return loss_fn(torch.func.functional_call(model, state, tuple(cast(t) for t in inputs)), cast(targets))


def gathered_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient at its full value, for every rank's parameters, on every rank.

    Collective: every rank calls it. ``module.named_parameters()`` are the tensors the optimizer updates:
    DTensors with the plan's placements, under ZeRO-1/2 the dp- (and cp-) sharded copies onto which the gradients
    were reduce-scattered (``passes/zero.py``).
    """
    return gathered({name: p.grad for name, p in module.named_parameters() if p.grad is not None})


def gathered(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's named tensors (DTensors are gathered to their full value), and every other rank's, on
    every rank. Collective: every rank calls it. A pipeline rank holds only its stages' parameters, so
    after gathering on their stage meshes the ranks exchange what they hold. Each is copied into storage of
    its own before it is pickled: a gradient is a view of its bucket (``passes/gradient_sync.py``), which
    pickling would send whole with every gradient (a 12-layer model's 26 MB of gradients became 5 GB a rank,
    and the gather ran out of memory)."""
    mine = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in tensors.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: t for held in everyone for name, t in held.items()}


def train_module(pm: Any, bundle: ModelBundle, steps: int, seed: int, rank: int,
                 clip: tuple[float, float] | None = None) -> dict[str, Any]:
    """Train autopar's module ``pm`` (``ParallelModule`` or ``PipelineParallelModule``) ``steps`` SGD
    steps on the global batches of ``seed``, with ``clip`` (max_norm, norm_type) by ``pm.clip_grad_norm_``
    after each backward if given. Every rank returns its losses; rank 0 also the gathered gradients after
    the first backward and final parameters (``AutoparResult.from_ranks`` reads them)."""
    opt = sgd(pm.parameters())
    losses, grads = [], {}
    for i, batch in enumerate(batches(bundle, steps, seed)):
        opt.zero_grad()
        losses.append(pm.step(*batch).item())
        if clip is not None:
            pm.clip_grad_norm_(*clip)
        if i == 0:
            grads = gathered_grads(pm)
        opt.step()
    params = pm.full_state_dict()
    names = {name for name, _ in bundle.model.named_buffers()}
    buffers = gathered({k: v for k, v in pm.state_dict().items() if k in names})
    return {"losses": losses, "grads": grads if rank == 0 else None, "params": params if rank == 0 else None,
            "buffers": buffers if rank == 0 else None,
            "plan": pm.plan.to_dict(), "redistributes": pm.redistributes, "lowered": pm.lowering}


def train_counting(pm: Any, bundle: ModelBundle, steps: int, seed: int) -> dict[str, Any]:
    """``train_module``'s run of ``pm`` on every rank, with the collectives of the last step counted
    (``CollectiveCounter``): losses, the gathered gradients after the first backward, the final parameters,
    the plan, the redistributes and ``counted``."""
    opt = sgd(pm.parameters())
    losses, grads, counted = [], {}, {}
    for i, batch in enumerate(batches(bundle, steps, seed)):
        opt.zero_grad()
        with CollectiveCounter() as comm:
            losses.append(pm.step(*batch).item())
        counted = comm.counts
        if i == 0:
            grads = gathered_grads(pm)
        opt.step()
    return {"losses": losses, "grads": grads, "params": pm.full_state_dict(), "plan": pm.plan.to_dict(),
            "redistributes": pm.redistributes, "counted": counted}


def train_parallel_rank(rank: int, world: int, name: str, overrides: Mapping[str, Any] | None,
                        global_batch: int, seq: int | None, steps: int, plan: dict | None,
                        constraints: Mapping[str, Any] | None, seed: int = 0,
                        under: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                        lowered: bool | None = False, compile: bool = False,
                        clip: tuple[float, float] | None = None) -> dict[str, Any]:
    """One rank's training under ``plan`` (or a plan made here for this world), as ``train_module``;
    ``lowered``: on the lowered runtime (``autoparallelize(..., lowered=True)``), on DTensor (False, the
    runtime these parity runs check unless told; a plan made here is then priced for it, ``runtime=dtensor``
    unless ``constraints`` pin one), or on ``autoparallelize``'s default (None); ``compile``: the lowered
    program compiled by inductor (``compile=True``); ``clip``: as ``train_module``'s.

    ``under``, if given, is called on the rank and the run made inside the context it returns: a test
    perturbs the runtime there (a picklable, module-level function) to prove the check fails.
    """
    with under() if under else contextlib.nullcontext():
        bundle = build(name, overrides, global_batch, seq, seed)
        on_dtensor = lowered is False and not compile and plan is None
        pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets,
                             constraints=planned_for_dtensor(constraints) if on_dtensor else constraints,
                             plan=Plan.from_dict(plan) if plan else None, lowered=lowered, compile=compile)
        return train_module(pm, bundle, steps, seed, rank, clip)


def train_parallel(world: int, name: str, overrides: Mapping[str, Any] | None, global_batch: int,
                   seq: int | None, steps: int, plan: dict | None = None,
                   constraints: Mapping[str, Any] | None = None, seed: int = 0) -> AutoparResult:
    return AutoparResult.from_ranks(run_on_ranks(train_parallel_rank, world, name, overrides, global_batch, seq,
                                                 steps, plan, constraints, seed))


def _train_many_rank(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_parallel_rank(rank, world, **run) for run in runs]


def train_parallel_many(world: int, runs: list[dict[str, Any]]) -> list[AutoparResult]:
    """Several ``train_parallel_rank`` runs (keyword dicts) in one set of processes: one spawn, one group."""
    per_rank = run_on_ranks(_train_many_rank, world, runs)
    return [AutoparResult.from_ranks([r[i] for r in per_rank]) for i in range(len(runs))]
