"""The parameters a step's program reads, made from the parameters the optimizer steps; mixed precision.

A plan's ``precision`` (``autopar.core.plan.Precision``) names the dtype the program computes in, the
optimizer's (master) parameters' dtype (fp32, or bf16 where ``master_dtype`` pins it) and the gradient
reductions' dtype. When the compute dtype is narrower than the masters' the step runs in mixed
precision (Micikevicius et al., "Mixed Precision Training", ICLR 2018), as ``ProgramParameters``
arranges it:

* **master weights**: every parameter, as the plan places it, in fp32; the optimizer steps these
  (``optimizer_parameters``), so its state and updates keep full precision;
* **compute copies**: the program reads the masters and casts them where it computes with them
  (``cast_parameters``, a graph pass): every op that reads a parameter, or a view of one, reads it
  through ``to_compute_dtype`` (a local op on each shard, no communication), and a parameter gathered
  for an op (FSDP) is cast as a shard and then gathered (``reshard.gather_parameter``), so the gather
  moves compute-dtype bytes and its backward reduce-scatters the gradient in the reduction dtype. The
  casts are part of autograd's graph: every microbatch's backward runs through them and accumulates
  each gradient on its master in fp32;
* **ZeRO-1/2** (``passes/zero.py``): the optimizer's dp-shards are the masters and the program's whole
  parameters are compute-dtype leaves, gathered from the cast shards before each step;
* **reductions outside the program** (``GradientSync``'s all_reduce, ZeRO's reduce_scatter) run in the
  plan's ``precision.reduce`` and hand the optimizer fp32 gradients.

Without mixed precision the program reads the masters themselves: in fp32, or, with bf16 masters
(``precision.master`` bf16, NeMo's ``optim.dtype: bf16``), in bf16, where gradients
accumulate in bf16 on the masters (under ZeRO-1/2 on the whole bf16 parameters, then reduce-scattered
in ``precision.reduce`` onto the bf16 shards) and the user's optimizer creates its state like its
parameters (``torch.optim.AdamW``'s moments: bf16). The captured program was traced with
the model in the compute dtype (``autopar.ir.capture.capture``'s ``dtype``), so the model's own casts
(a norm computed in fp32, then cast back) run as captured, and float buffers and inputs are cast to
the compute dtype on their way in.

Where we diverge from ``torch.autocast``: autocast picks a dtype per op at dispatch; autopar's program
is decided ahead of time, in one dtype, so what runs is what was priced. FSDP2's
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` makes the same collectives as our gathers.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.plan import Precision

from .gradient_sync import GradientSync
from .reshard import gather_parameter
from .zero import ShardedOptimizerState

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""A plan's dtype names as torch dtypes."""


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype the program computes in when it differs from the masters' (mixed precision), else None."""
    return TORCH_DTYPES[precision.compute] if precision.mixed else None


def program_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype the program computes in where the model's (fp32) parameters are not already in it: the
    compute dtype, under fp32 masters (mixed precision) and bf16 masters alike; None in fp32. The model is
    captured in it (``autoparallelize``) and its float buffers and inputs are cast to it."""
    return TORCH_DTYPES[precision.compute] if precision.compute != "fp32" else None


def as_master(tensor: torch.Tensor, precision: Precision) -> torch.Tensor:
    """A model's parameter in the masters' dtype (itself when it is already), trainable as the model's is. A
    frozen parameter (``requires_grad=False``) stays frozen, and in the compute dtype: no optimizer steps it,
    so a wider master copy would only hold memory (Llama 3 70B with adapters: 280 GB of fp32 copies of the
    140 GB of bf16 weights the program reads)."""
    frozen = not tensor.requires_grad
    dtype = TORCH_DTYPES[precision.compute if frozen and tensor.is_floating_point() else precision.master]
    return tensor.detach().to(dtype).requires_grad_(not frozen)


def to_compute_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter (or a view of one) as an op computes with it (the printed program's name for the cast)."""
    return x.to(dtype)


def cast_parameters(gm: fx.GraphModule, parameter_values: set[str], precision: Precision) -> int:
    """Make ``gm`` compute with its parameters in the compute dtype, in place; returns the casts added.

    ``parameter_values`` are the parameters' placeholders and the views of them (which stay in the
    masters' dtype: a view moves no data). Every gather of one casts the shard first and reduces the
    gradient in ``precision.reduce`` (``gather_parameter``'s dtypes); every other op reading one reads
    it through its own ``to_compute_dtype`` node (one per reader, so a pipeline split never sends a
    cast parameter from one stage to another)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return 0
    casts = 0
    for node in list(gm.graph.nodes):
        if node.name not in parameter_values:
            continue
        for user in list(node.users):
            if user.target is gather_parameter:
                user.kwargs = {**user.kwargs, "compute_dtype": dtype, "reduce_dtype": TORCH_DTYPES[precision.reduce]}
            elif user.name not in parameter_values:
                with gm.graph.inserting_before(user):
                    cast = gm.graph.call_function(to_compute_dtype, (node, dtype))
                user.replace_input_with(node, cast)
                casts += 1
    gm.graph.lint()
    gm.recompile()
    return casts


def in_compute_dtype(tensor: torch.Tensor, precision: Precision) -> torch.Tensor:
    """A float buffer or input in the program's compute dtype; anything else as it is."""
    dtype = program_dtype(precision)
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


class ProgramParameters:
    """The optimizer's parameters of one rank (``masters``: key -> parameter with the plan's placements,
    in the masters' dtype) and, each step, the values its program reads for them.

    ``begin_step()`` before a step's first forward returns key -> the value the program reads (under
    ZeRO after gathering the updated shards); ``arm(m)`` before backward lets the gradient reductions
    start during the ``m``-th accumulation (the last microbatch's backward); ``end_step()`` after
    backward finishes them, leaving each optimizer parameter's gradient reduced, in its own dtype.
    """

    def __init__(self, masters: Mapping[str, nn.Parameter], mesh: DeviceMesh, precision: Precision,
                 zero_stage: int):
        self.dtype = compute_dtype(precision)
        self.keys = list(masters)
        reduce_dtype = TORCH_DTYPES[precision.reduce]
        trainable = {key: p for key, p in masters.items() if p.requires_grad}  # frozen: no gradient, no state
        self.zero = (ShardedOptimizerState(trainable, mesh, zero_stage, self.dtype, reduce_dtype)
                     if zero_stage in (1, 2) and trainable else None)
        sharded = self.zero.shards if self.zero else {}
        self.masters = {key: p for key, p in masters.items() if key not in sharded}  # the program casts these
        self.grad_sync = GradientSync([p for p in self.masters.values() if p.requires_grad], reduce_dtype=reduce_dtype)

    def optimizer_parameters(self) -> dict[str, nn.Parameter]:
        """Key -> the parameter the optimizer steps: a master, or under ZeRO-1/2 its dp-shard."""
        shards = self.zero.shards if self.zero else {}
        return {key: shards[key] if key in shards else self.masters[key] for key in self.keys}

    def begin_step(self) -> dict[str, torch.Tensor]:
        """The values the program reads this step: the masters (which it casts: ``cast_parameters``),
        and under ZeRO-1/2 the whole parameters gathered from the updated shards."""
        if self.zero:
            self.zero.gather()
        return {**(self.zero.full if self.zero else {}), **self.masters}

    def arm(self, accumulations: int = 1) -> None:
        self.grad_sync.arm(accumulations)
        if self.zero:
            self.zero.arm(accumulations)

    def end_step(self) -> None:
        self.grad_sync()
        if self.zero:
            self.zero.reduce_gradients()
