"""``ParallelModule``: one rank's share of a model, running the plan's per-rank program.

Built from a model, a captured graph and a Plan (the passes do the rewriting, in the order
``autopar.passes`` states):

* parameters and buffers are sharded to DTensors with the plan's placements;
* the program is ``autopar.passes.build_program``'s one stage program, the whole captured forward+loss
  graph rewritten: values in it are DTensors, so DTensor computes local shapes and the collectives of
  each redistribute, and autograd derives the backward (with the dual collectives); gathered
  parameters are gathered again in backward and the recomputed layers run under
  ``torch.utils.checkpoint``, as the plan priced them;
* ``step`` runs forward, loss and backward, with the bucketed gradient synchronization overlapped
  with the last microbatch's backward (a lowered program's loss is read after backward: its global
  sum is waited on there, ``LoweredProgram.start``);
* under ZeRO-1/2 (``plan.degrees.zero``) ``parameters()`` are dp- (and cp-) sharded copies the program's
  replicated parameters are gathered from before each step, and gradients are reduce-scattered onto
  them (``passes/zero.py``), so the optimizer's state is sharded as the plan priced it;
* under mixed precision (``plan.precision``) ``parameters()`` are fp32 master weights and the program
  reads compute-dtype copies made at the start of each step (``passes/mixed_precision.py``).
* with ``lowered=True`` the program runs as the forward and backward graphs of local tensor ops and
  explicit collectives that AOT autograd derives from it at its first call (``passes/lower.py``;
  ``compile=True``: compiled by inductor); everything above stays outside those graphs.

Where we diverge from rewriting local shapes into the graph ourselves: DTensor already maps global
shape arguments (``view``, ``expand``...) to local ones for every op it shards, so the graph keeps
global shapes and one set of rules stays in one place.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.core.batch import microbatch_pieces
from autopar.core.errors import BadInputError
from autopar.core.plan import Plan
from autopar.ir.buffer_writes import reading_copies, refuse_evaluation_that_writes, writing_buffers, written
from autopar.ir.capture import CapturedGraph
from autopar.ir.loss_reduction import loss_reduction
from autopar.passes import ProgramParameters, build_program, shard_parameters, shard_tensor
from autopar.passes.dropout_mode import in_mode, refuse_step_that_cannot_train
from autopar.passes.lower import LoweredProgram, lowering_of
from autopar.passes.mixed_precision import as_master, in_compute_dtype
from autopar.runtime.autocast import CallerAutocast
from autopar.runtime.checkpoint import load_module_state_dict, module_state_dict, state_names
from autopar.runtime.deferred_init import InitWeights, ShardedInit, holds_meta_tensors
from autopar.runtime.fits import check_plan_fits
from autopar.runtime.grad_norm import clip_grad_norm
from autopar.runtime.inputs import carries_batch, check_user_inputs, microbatch_weights, user_input
from autopar.runtime.loss_scale import DynamicLossScale
from autopar.runtime.mesh import init_job_mesh, job_device_type
from autopar.runtime.randomness import StepRandomness


def mesh_for_plan(plan: Plan, device_type: str | None = None) -> DeviceMesh:
    """The plan's device mesh over the current process group's ranks."""
    if not dist.is_initialized():
        raise BadInputError("autoparallelize needs an initialized process group: run under torchrun, "
                            "or call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if plan.mesh.devices != world:
        raise BadInputError(f"the plan's mesh {plan.mesh.shape} needs {plan.mesh.devices} ranks, this job has {world}")
    device_type = device_type or job_device_type()
    return init_job_mesh(device_type, tuple(plan.mesh.shape), tuple(plan.mesh.dim_names))


class ParallelModule(nn.Module):
    """The parallelized training step of one rank. Hand ``parameters()`` to any torch optimizer."""

    def __init__(self, model: nn.Module, captured: CapturedGraph, plan: Plan, mesh: DeviceMesh,
                 check_memory: bool = True, lowered: bool = False, compile: bool = False,
                 init_weights: InitWeights | None = None):
        super().__init__()
        if check_memory:  # before anything is sharded: a plan too large for this device is refused (fits.py)
            check_plan_fits(plan, mesh.device_type)
        self.plan = plan
        self.mesh = mesh
        self.captured = captured
        self.randomness = StepRandomness()  # dropout masks alike on the ranks that hold a replica
        self.autocast = CallerAutocast(mesh.device_type, plan.precision, captured.autocast)
        self._carriers = [carries_batch(plan, name) for name in captured.user_inputs]  # cut into microbatches
        self._loss_reduction = loss_reduction(captured)  # how microbatches' losses add up (``microbatch_weights``)
        self.loss_scale = DynamicLossScale() if plan.precision.compute == "fp16" else None  # fp16's small gradients
        precision = plan.precision
        deferred = (ShardedInit(model, mesh, plan.placements, plan.buffers, init_weights)
                    if holds_meta_tensors(model) else None)  # built on meta: shards allocated and initialized here
        if deferred:
            deferred.run()
        named_params = {fqn: as_master(p, precision) for fqn, p in model.named_parameters()}
        masters = shard_parameters(named_params, plan.placements, mesh)
        self._program_params = ProgramParameters({_key(k): v for k, v in masters.items()}, mesh, precision,
                                                 plan.degrees.zero or 0)
        self._params = nn.ParameterDict(self._program_params.optimizer_parameters())
        self._fqns = {_key(fqn): fqn for fqn in plan.placements}  # ParameterDict keys cannot hold dots
        named_buffers = dict(model.named_buffers())
        self._buffers_dt = {fqn: shard_tensor(in_compute_dtype(named_buffers[fqn], precision), mesh, pl)
                            for fqn, pl in plan.buffers.items()}
        self._state_names = state_names(model)  # what state_dict() saves (runtime/checkpoint.py)
        if deferred:
            deferred.release()
        self._written = written(captured.graph)  # buffers the step writes, each forward (``ir/buffer_writes.py``)
        self._constants = {n: shard_tensor(t, mesh, ["R"] * mesh.ndim) for n, t in captured.constants.items()}
        built = build_program(plan, captured, mesh)
        (stage,) = built.stages
        self.redistributes = built.redistributes
        self._dropout_ops = built.dropout_ops
        self._placeholders = stage.program.placeholders
        self._step_casts = built.step_casts
        in_graph_sync = self._program_params.grad_sync if self.microbatches == 1 else None  # else reduced once, after
        self.program = (LoweredProgram(stage.module, self._parameter_names(), compile=compile, grad_sync=in_graph_sync,
                                       hooked_gradients=True) if lowered or compile else stage.module)

    # ---- parameters ---------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters to optimize: the plan's shards (under ZeRO-1/2, the dp- (and cp-) sharded copies; under
        mixed precision, in fp32)."""
        for k, p in self._params.items():
            yield prefix + self._fqns[k], p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full (global) value, on every rank: tensors of their own, which the
        optimizer's next step leaves as they are (a replicated parameter's ``full_tensor`` is its own storage)."""
        return {fqn: _own_copy(p.detach().full_tensor(), p) for fqn, p in self.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model (``runtime/grad_norm.py``): gradients scaled
        so that their total norm is at most ``max_norm``; returns the total norm, the same on every rank."""
        return clip_grad_norm(self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach)

    @property
    def lowering(self) -> dict[str, Any]:
        """Its lowered programs (``lowered=True``), and why any runs on DTensor instead (``lower.lowering_of``)."""
        return lowering_of(self)

    # ---- running ------------------------------------------------------------------------------
    def forward(self, *inputs: torch.Tensor, local: bool = False) -> DTensor:
        """The loss as a replicated DTensor (forward only; use ``step`` to train). Under ``torch.inference_mode``
        it runs under ``torch.no_grad`` instead: DTensor's views cannot make inference tensors."""
        check_user_inputs(self.plan, self.mesh, self.captured.user_inputs, inputs, local, 1, "forward()")
        refuse_evaluation_that_writes(self.training, self._written, "forward()")
        evaluating = not self.training and self._dropout_ops > 0  # its dropout off: lowered graphs drop
        inference = torch.is_inference_mode_enabled()
        with self.autocast.set_aside("forward()"), self.randomness.drawing(), in_mode(self.training), \
                torch.inference_mode(False) if inference else contextlib.nullcontext(), \
                torch.no_grad() if inference else contextlib.nullcontext():
            return self._run_program(self._step_values(), inputs, local, on_dtensor=evaluating)

    def _run_program(self, step_values: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor], local: bool,
                     deferred: bool = False, on_dtensor: bool = False) -> DTensor:
        """The program's loss (``step_values``: ``_step_values``); ``deferred``: a lowered program's may still be
        reducing, readable after ``_finish_loss`` (``LoweredProgram.start``); ``on_dtensor``: a lowered program's
        DTensor program runs."""
        args = self._placeholder_values(step_values, inputs, local)
        lowered = isinstance(self.program, LoweredProgram)
        with writing_buffers(self._buffers_dt):
            if lowered and on_dtensor:
                (loss,) = self.program.dtensor_program(*args)
            else:
                (loss,) = self.program.start(*args) if deferred and lowered else self.program(*args)
        return loss

    def _finish_loss(self) -> None:
        """Complete the loss of a deferred ``_run_program``."""
        if isinstance(self.program, LoweredProgram):
            self.program.finish()

    @property
    def microbatches(self) -> int:
        return self.plan.pipeline.microbatches

    def step(self, *args: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Forward, loss and backward on the global batch (or this rank's slice with ``local=True``).

        With ``microbatches`` m > 1 the batch is cut into m equal pieces along dim 0 and gradients
        accumulate, each piece's loss weighted so that they add up to the batch's (``microbatch_weights``: a
        mean's 1/m, a sum's 1, a count-divided sum's share of the count). Gradients are left on
        ``parameters()``, synchronized; returns the batch's loss.
        """
        m = self.microbatches
        check_user_inputs(self.plan, self.mesh, self.captured.user_inputs, args, local, m, "step()")
        refuse_step_that_cannot_train(self.training, self._dropout_ops)
        refuse_evaluation_that_writes(self.training, self._written, "step()")
        total = torch.zeros(())
        scale = self.loss_scale.before_backward(list(self.parameters())) if self.loss_scale else 1.0
        with self.autocast.set_aside("step()"), self.randomness.step():
            step_values = self._step_values()
            pieces = microbatch_pieces(args, m, self._carriers)
            weights = microbatch_weights(self._loss_reduction, pieces, self.plan, self.mesh,
                                         self.captured.user_inputs, local)
            # a microbatch that counts none of the targets its loss divides by adds nothing, and its loss is 0/0
            kept = [i for i, weight in enumerate(weights) if weight > 0] or list(range(m))
            for i in kept:
                piece, weight = pieces[i], weights[i]
                loss = self._run_program(step_values, piece, local, deferred=True).to_local()
                if i == kept[-1]:
                    self._program_params.arm()  # reduce gradients as the last backward produces them
                (loss * (weight * scale)).backward()
                self._finish_loss()  # the loss's reduction waited on after backward, as DDP's ranks meet only there
                total = total + loss.detach().float() * weight
        self._program_params.end_step()
        if self.loss_scale:  # unscaled, or dropped where a rank's overflowed (the caller's optimizer step skipped)
            self.loss_scale.after_backward(list(self.parameters()), torch.device(self.mesh.device_type))
        return total

    def _parameter_names(self) -> dict[int, str]:
        """Which of the program's arguments are parameter values: position -> parameter name."""
        return {i: self.captured.params[name] for i, name in enumerate(self._placeholders)
                if name in self.captured.params}

    def _step_values(self) -> dict[str, torch.Tensor]:
        """Placeholder name -> what the program reads for it this step, the same in every microbatch: each
        parameter's value (``ProgramParameters.begin_step``) and the float8 casts of the weights made from them
        (``passes/float8.StepCasts``)."""
        params, fqn = self._program_params.begin_step(), self.captured.params
        read = {name: params[_key(fqn[name])] for name in self._placeholders if name in fqn}
        return {**read, **self._step_casts.made_from(read.__getitem__, self._placeholders)}

    def _placeholder_values(self, step_values: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor],
                            local: bool) -> list[Any]:
        cg, precision = self.captured, self.plan.precision
        user = {n: in_compute_dtype(user_input(self.plan, self.mesh, n, x, local), precision)
                for n, x in zip(cg.user_inputs, inputs)}
        buffers = reading_copies(self._buffers_dt, self._written)
        values = []
        for name in self._placeholders:
            if name in step_values:
                values.append(step_values[name])
            elif name in cg.buffers:
                values.append(buffers[cg.buffers[name]])
            elif name in cg.constants:
                values.append(self._constants[name])
            else:
                values.append(user[name])
        return values

    # ---- checkpoints (runtime/checkpoint.py) ---------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, DTensor]:
        """The model's FQN -> DTensor of global shape (parameters as ``named_parameters()``, persistent
        buffers), sharing storage: ``dcp.save`` / ``dcp.load`` of it reshards between plans."""
        return module_state_dict([*self.named_parameters(), *self._buffers_dt.items()], self._state_names)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy FQN -> full tensor or DTensor (any placement) into this rank's shards."""
        load_module_state_dict(self.state_dict(), state_dict, self._state_names, strict)


def _own_copy(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """``full`` (``param``'s full value), copied where it shares ``param``'s storage."""
    shares = full.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr()
    return full.clone() if shares else full


def _key(fqn: str) -> str:
    return fqn.replace(".", "/")
