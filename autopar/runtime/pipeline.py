"""Pipeline-parallel execution of a plan: the rank's program cut into stages, run by
``torch.distributed.pipelining``.

A plan with ``degrees["pp"] = p`` runs on ``p x (stage mesh)`` ranks, the stage dimension outermost
(global rank = stage * stage_mesh_size + rank_in_stage); ``plan.mesh`` is one stage's submesh and
``plan.pipeline.stages`` lists ``p v`` layer ranges (chunk ``i`` on stage ``i mod p``).

Design (docs/architecture.md "Execution", "pipeline stages are slices of that graph"):

1. **The program.** ``autopar.passes.build_program`` rewrites the captured forward+loss graph, at the
   microbatch shape, with the same passes ``ParallelModule`` runs (every value is a DTensor on the
   stage's submesh, so data and tensor parallelism inside a stage work as without a pipeline), and
   cuts it into one stage program per chunk (``passes/split_stages.py``).
2. **Running** (``PipelineParallelModule``). Each of this rank's chunks is a ``StageModule`` that takes
   and returns plain local tensors: received values become DTensors with the plan's placements of that
   value (``DTensor.from_local`` with the global shape), values it sends are brought off any
   ``Partial`` placement and sent as local shards (``split_stages.Boundary``); a lowered chunk that runs its
   forward under eager autograd takes and gives the local tensors as they are, where the boundaries are
   placed as its traced arguments and outputs (``StageModule.local_io``, ``passes/lower_eager.py``).
   ``torch.distributed.pipelining`` ``PipelineStage`` (with static shapes, so no shape-inference
   round) and ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
   ``ScheduleInterleavedZeroBubble`` run the microbatches over the pipeline process group; the stage's
   gradients are synchronized in buckets over the stage
   mesh (``GradientSync``, armed for ``m`` accumulations: each bucket's all_reduce starts during the
   last microbatch's backward on that stage, as ``ParallelModule`` overlaps it and as pricing assumes).
   What a lowered eager chunk computes from its user inputs alone and sums over ranks (the last stage's
   count of targets) is reduced for every microbatch before the schedule runs, in one all_reduce
   (``_reduce_inputs_ahead``); ``AccumulatingStage`` tells each forward its microbatch.
3. **ZeRO-1/2 inside a stage** (``plan.degrees.zero`` 1 or 2, Megatron-LM's distributed optimizer with
   pipelines): the stage's parameters get ``passes/zero.py``'s dp- (and cp-) sharded copies, which
   ``parameters()`` hands to the optimizer; before the schedule runs they refresh the stage's whole
   parameters (all_gather), and gradients are reduce-scattered onto them (ZeRO-2 as each microbatch's
   backward accumulates them, ZeRO-1 after the schedule), exactly as in ``ParallelModule``.
4. **Mixed precision** (``plan.precision``): the stage's optimizer parameters are fp32 masters and its
   chunks read compute-dtype copies made before each schedule step (``passes/mixed_precision.py``'s
   ``ProgramParameters``, as in ``ParallelModule``).

Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; torch's
``ScheduleInterleavedZeroBubble``) splits each chunk's backward into an input-gradient step, which the
previous chunk waits for, and a weight-gradient step run later in the bubbles. Torch splits the autograd
graph at the chunk module's ``parameters()``, so a ``StageModule``'s are the leaves its program reads this
step (under ZeRO with mixed precision, compute-dtype copies, not the optimizer's parameters); its input-
gradient step detaches the chunk's outputs in place, so they are copies, never views
(``DTensor.to_local``'s); and its weight-gradient step writes ``.grad`` itself instead of through
autograd's accumulation, so ``AccumulatingStage`` runs the hooks the gradient sync and ZeRO-2 take
gradients from (without it a later stage's gradients are never reduced).

Where we diverge from pipelining's usual use: the loss is part of the last chunk's graph (it was
captured with the model), so the schedule's ``loss_fn`` only weights it (``inputs.microbatch_weights``: a
mean's ``1 / m``, a count-divided sum's share of the count), the schedule's ``target`` is the microbatch
index, and ``scale_grads=False``: the sum of the ``m`` weighted backward passes is the batch's loss,
exactly as ``ParallelModule.step`` accumulates it. User inputs reach the first chunk as positional
arguments; later chunks that read one (the targets, for the loss) get it as a keyword argument, which
pipelining hands to every chunk of a rank and splits into microbatches like the positional ones.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.tensor import DTensor

from autopar.core.batch import microbatch_pieces
from autopar.core.errors import BadInputError
from autopar.core.plan import MULTI_CHUNK_SCHEDULES, Plan
from autopar.ir.buffer_writes import reading_copies, refuse_evaluation_that_writes, writing_buffers, written
from autopar.ir.capture import CapturedGraph
from autopar.ir.loss_reduction import loss_reduction
from autopar.passes import ProgramParameters, Stage, build_program, shard_parameters, shard_tensor
from autopar.passes.dropout_mode import refuse_step_that_cannot_train
from autopar.passes.lower import LoweredProgram, lowering_of
from autopar.passes.lower_eager import EagerForward
from autopar.passes.lower_writes import written_value
from autopar.passes.mixed_precision import TORCH_DTYPES, as_master, in_compute_dtype
from autopar.passes.tied_parameters import TiedGradientSync, stages_reading
from autopar.runtime.autocast import CallerAutocast
from autopar.runtime.checkpoint import load_module_state_dict, module_state_dict, state_names
from autopar.runtime.deferred_init import InitWeights, ShardedInit, holds_meta_tensors
from autopar.runtime.fits import check_plan_fits
from autopar.runtime.grad_norm import clip_grad_norm
from autopar.runtime.inputs import (carries_batch, check_user_inputs, microbatch_shape, microbatch_weights,
                                    pipeline_chunk_spec, user_input, user_input_shard)
from autopar.runtime.loss_scale import DynamicLossScale
from autopar.runtime.mesh import init_job_mesh, job_collective_timeout, job_device_type
from autopar.runtime.randomness import StepRandomness

ZERO_BUBBLE = {"zero_bubble": "ScheduleInterleavedZeroBubble"}
"""Zero-bubble schedules (Qi et al., ICLR 2024: backward split into input- and weight-gradient steps) by
the name of torch's class, run where the installed torch has it."""
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             **{name: getattr(torch_schedules, cls) for name, cls in ZERO_BUBBLE.items()
                if hasattr(torch_schedules, cls)}}
"""Schedule name -> the torch class that runs it (``MULTI_CHUNK_SCHEDULES`` take a list of stages, a
rank's chunks; the others one stage a rank)."""


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous. Pipelining sends each received value's
    gradient back with ``isend``, which takes contiguous tensors only, and a chunk that reads its input
    transposed (SqueezeBERT's convolutions over ``[batch, channels, seq]``) makes a strided one."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageModule(nn.Module):
    """One chunk as pipelining runs it: local tensors in and out, DTensors on the stage mesh inside.

    Positional inputs are the user inputs (first chunk) or the previous chunk's outputs; user inputs a
    later chunk reads arrive as keyword arguments. Parameters are this rank's shards of the chunk's.
    """

    def __init__(self, stage: Stage, values: Mapping[str, Any], user_input: Callable[..., torch.Tensor],
                 user_names: list[str], mesh: DeviceMesh, written: Mapping[str, str]):
        """``written``: placeholder -> name of each buffer the chunk writes (``ir/buffer_writes.py``)."""
        super().__init__()
        self.index = stage.program.index
        self.program = stage.module
        self.placeholders = stage.program.placeholders
        self.inputs, self.outputs = stage.received, stage.sent
        self.values = dict(values)  # placeholder name -> parameter / buffer / constant (DTensors)
        self.written = set(written)  # read as copies, and written by name:
        self._writing = {name: self.values[placeholder] for placeholder, name in written.items()}
        self._user_input = user_input
        self.user_names = user_names
        self.reads = [n for n in self.placeholders if n in user_names]  # user inputs this chunk reads
        self.mesh = mesh
        self.copies_outputs = False  # set under schedules that detach the outputs in place (``_schedule``)
        self.microbatch: int | None = None  # of the coming forward (``AccumulatingStage.forward_one_chunk``)
        self.local_io: bool | None = None  # received and sent as local tensors (``_reads_and_writes_locally``)

    def lower(self, params: Mapping[str, str], compile: bool) -> None:
        """Run the chunk's program as its lowered forward and backward graphs of local ops and explicit
        collectives (``passes/lower.py``; ``compile``: compiled by inductor), traced at its first
        microbatch; ``params`` maps the captured graph's parameter placeholders to their names. The
        stage's gradient sync stays outside the graphs, on the parameters' accumulation hooks, as the
        schedule accumulates ``m`` microbatches: the graphs read the parameters as local tensors and hand
        each gradient, unreduced, to those hooks (``LoweredProgram``'s ``hooked_gradients``)."""
        first = len(self.inputs) if self.index > 0 else 0  # the program reads the received values first
        positions = {first + i: params[name] for i, name in enumerate(self.placeholders) if name in params}
        self.program = LoweredProgram(self.program, positions, compile=compile, hooked_gradients=True)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The leaves the chunk's program reads this step (``PipelineParallelModule._read_parameters``: under
        ZeRO with mixed precision, compute-dtype copies of the optimizer's parameters), each once: what
        a zero-bubble schedule's input-gradient step splits the backward at (``stage_backward_input``)."""
        return iter({id(v): v for v in self.values.values() if isinstance(v, nn.Parameter)}.values())

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        local = self.local_io is True
        if self.index == 0:
            received, users = [], dict(zip(self.user_names, args))
        else:
            args = tuple(_ContiguousGradient.apply(x) if x.requires_grad else x for x in args)
            received = list(args) if local else [b.to_dtensor(x, self.mesh) for b, x in zip(self.inputs, args)]
            users = kwargs
        held = reading_copies(self.values, self.written)
        values = [held[n] if n in held else self._user_input(n, users[n], as_local=local) for n in self.placeholders]
        eager = getattr(self.program, "eager", None)
        if eager is not None:
            eager.microbatch = self.microbatch
        with writing_buffers(self._writing):
            ran = self.program.start_locally(*received, *values) if local else self.program(*received, *values)
        if local:
            outs = tuple(v.contiguous() for v in ran)
        else:
            outs = tuple(b.to_local(v) for b, v in zip(self.outputs, ran))
            if self.local_io is None and isinstance(self.program, LoweredProgram) and self.program.eager is not None:
                self.local_io = self._reads_and_writes_locally(self.program.eager)
        if self.copies_outputs:
            outs = tuple(out.clone() if out._is_view() else out for out in outs)
        return outs[0] if len(outs) == 1 else outs

    def input_names(self, positions: Sequence[int]) -> list[str] | None:
        """The placeholder names of the program's arguments at ``positions``, or None where one is a value the
        chunk receives from the previous one (the program reads those first)."""
        received = len(self.inputs) if self.index > 0 else 0
        if any(i < received for i in positions):
            return None
        return [self.placeholders[i - received] for i in positions]

    def _reads_and_writes_locally(self, eager: EagerForward) -> bool:
        """Whether the chunk, whose lowered program runs under eager autograd, passes the values it receives
        to it as the local tensors they arrive as and sends its outputs as the local tensors it returns
        (``LoweredProgram.start_locally``): each is placed as its boundary says, and each received value's
        gradient leaves so, so DTensor's wrapping there and unwrapping on the other side, forward and
        backward (four DTensor conversions a microbatch, about 1.5 ms a step on the benchmark's GPT
        stages), would move nothing."""
        received = range(len(self.inputs)) if self.index > 0 else range(0)
        return all(eager.reads_locally(i, self.inputs[i].placements) for i in received) \
            and eager.writes_locally([b.placements for b in self.outputs], len(self.program.writes))


class AccumulatingStage(PipelineStage):
    """A ``PipelineStage`` whose weight-gradient step (a zero-bubble schedule's W) files gradients as
    autograd's accumulation does. Torch's ``stage_backward_weight`` computes them with ``autograd.grad``
    and adds them to ``.grad`` itself, so the parameters' post-accumulate-grad hooks, where
    ``GradientSync`` and ZeRO take each gradient (``passes/gradient_sync.py``, ``passes/zero.py``), would
    not run: they are run here for every gradient the step changed that autograd did not accumulate (on
    the first stage, whose W is a whole backward, autograd did). The step's last backward of a lowered
    chunk that sums gradients in its leaves files those sums (``LoweredProgram.filing_gradients``)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.microbatch = fwd_chunk_id  # the chunk's inputs reduced ahead are looked up by it
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.submod.microbatch = None

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, last_backward: bool = False, **kwargs: Any) -> None:
        program = getattr(self.submod, "program", None)
        files = last_backward and isinstance(program, LoweredProgram) and program.accumulates_in_leaves \
            and program.files_in_last_backward
        with program.filing_gradients() if files else contextlib.nullcontext():
            super().backward_one_chunk(bwd_chunk_id, *args, last_backward=last_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        params = [p for p in self.submod.parameters() if p.requires_grad]  # a frozen one gets no gradient
        before = [(p.grad, p.grad._version if p.grad is not None else None) for p in params]
        accumulated: set[int] = set()
        handles = [p.register_post_accumulate_grad_hook(lambda p: accumulated.add(id(p))) for p in params]
        try:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        finally:
            for handle in handles:
                handle.remove()
        for p, (grad, version) in zip(params, before):
            changed = p.grad is not grad or (grad is not None and grad._version != version)
            if changed and id(p) not in accumulated:  # torch keeps a tensor's hooks in this attribute
                for hook in tuple((p._post_accumulate_grad_hooks or {}).values()):
                    hook(p)


class PipelineParallelModule(nn.Module):
    """This rank's pipeline stage(s) of a plan with ``pp > 1``; ``parameters()`` are only its stages'.

    ``step`` runs the plan's schedule over ``m`` microbatches (forward, loss, backward), synchronizes
    the stage's gradients, and returns the global mean loss on every rank.
    """

    def __init__(self, model: nn.Module, captured: CapturedGraph, plan: Plan, device_type: str | None = None,
                 check_memory: bool = True, lowered: bool = False, compile: bool = False,
                 init_weights: InitWeights | None = None):
        super().__init__()
        self.plan, self.captured = plan, captured
        self._state_names = state_names(model)  # what state_dict() saves (runtime/checkpoint.py)
        self.world_mesh, self.mesh = pipeline_meshes(plan, device_type)
        if check_memory:  # before any stage is built: a plan too large for this device is refused (fits.py)
            check_plan_fits(plan, self.mesh.device_type)
        self.pp_group = self.world_mesh.get_group("pp")
        self.pp_rank, self.pp_size = self.world_mesh.get_local_rank("pp"), self.world_mesh.size(0)
        self.randomness = StepRandomness(stream=self.pp_rank)  # a stage's ranks draw alike, stages apart
        self.autocast = CallerAutocast(self.mesh.device_type, plan.precision, captured.autocast)
        built = build_program(plan, captured, self.mesh)
        self._leaf_sums = False  # lowered chunks sum gradients in their leaves (``_accumulate_in_leaves``)
        self._losses: list[tuple[int, torch.Tensor]] = []  # the last chunk's loss per microbatch (``_scaled_loss``)
        self._loss_reduction = loss_reduction(captured)  # how the microbatches' losses add up (``_microbatch_weights``)
        self._carriers = [carries_batch(plan, name) for name in captured.user_inputs]  # cut into microbatches
        self._weights: list[float] = []  # this step's (``_microbatch_weights``), the loss scale's included
        self.loss_scale = DynamicLossScale() if plan.precision.compute == "fp16" else None  # fp16's small gradients
        self.redistributes = built.redistributes
        self._dropout_ops = built.dropout_ops
        self._step_casts = built.step_casts  # float8 weights cast once a step (``_read_parameters``)
        self._written = written(captured.graph)  # buffers the step writes (``ir/buffer_writes.py``)
        mine = built.stages[self.pp_rank::self.pp_size]  # chunk i runs on stage i mod p
        self._sharded: dict[str, nn.Parameter] = {}  # fqn -> this rank's shard, one for all its chunks
        deferred = self._deferred_init(model, mine, init_weights)
        self.chunks = nn.ModuleList(self._stage_module(stage, model) for stage in mine)
        if deferred:
            deferred.release()
        if (lowered or compile) and plan.pipeline.schedule in ZERO_BUBBLE:
            warnings.warn("autopar: zero-bubble pipelines run on the DTensor runtime (torch splits each chunk's "
                          "backward at its parameters, inside what a lowered program runs as one graph); "
                          "lowered= and compile= are ignored", stacklevel=3)
        elif lowered or compile:
            for chunk in self.chunks:
                chunk.lower(captured.params, compile)
            self._accumulate_in_leaves(plan)
        self._local_inputs = False
        self.schedule = self._schedule(len(built.stages))
        self._program_params = ProgramParameters(dict(self._stage_parameters()), self.mesh, plan.precision,
                                                 plan.degrees.zero or 0)
        tied = stages_reading(built.stages, captured.params, self.pp_size)
        self._tied_sync = TiedGradientSync(tied, self.world_mesh, dict(self.named_parameters()),
                                           job_collective_timeout(self.mesh.device_type),
                                           TORCH_DTYPES[plan.precision.reduce])
        self._normed = [p for fqn, p in self.named_parameters()  # a tied weight's norm counted on its first stage
                        if fqn not in tied or tied[fqn][0] == self.pp_rank]

    # ---- parameters ---------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters to optimize: this rank's stages' shards (under ZeRO-1/2, the dp- (and cp-) sharded copies;
        under mixed precision, in fp32)."""
        for fqn, p in self._program_params.optimizer_parameters().items():
            yield prefix + fqn, p

    def _stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters this rank's chunks were built with, by fully qualified name (each once)."""
        yield from self._sharded.items()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model, all stages (``runtime/grad_norm.py``): this
        rank's gradients scaled so that the model's total norm is at most ``max_norm``; returns the total
        norm, the same on every rank. (torch's own over ``parameters()`` would clip each stage by its own.)"""
        return clip_grad_norm(self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach, self.pp_group,
                              self._normed)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model (all stages) gathered to its full value, on every rank."""
        mine = {fqn: p.detach().full_tensor() for fqn, p in self.named_parameters()}
        per_stage: list[Any] = [None] * self.pp_size
        dist.all_gather_object(per_stage, mine, group=self.pp_group)
        return {fqn: t for state in per_stage for fqn, t in state.items()}

    @property
    def lowering(self) -> dict[str, Any]:
        """Its lowered programs (``lowered=True``), and why any runs on DTensor instead (``lower.lowering_of``)."""
        return lowering_of(self)

    # ---- running ------------------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.plan.pipeline.microbatches

    def forward(self, *args: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Not offered: a pipeline plan's ranks run their stages inside the schedule ``step`` runs."""
        raise BadInputError(f"a pipeline plan (pp={self.pp_size}) has no forward-only call: its stages run inside "
                            "the schedule step() runs (forward, loss and backward); evaluate the loss with a "
                            "one-stage plan of the same model (autoparallelize(..., constraints={'pp': 1}) and "
                            "load_checkpoint), whose pm(inputs, targets) in eval mode is the loss without dropout")

    def step(self, *args: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Forward, loss and backward of the global batch (or this rank's slice with ``local=True``)
        through the pipeline; gradients are left on ``parameters()``, synchronized within the stage."""
        names = self.captured.user_inputs
        check_user_inputs(self.plan, self.mesh, names, args, local, self.microbatches, "step()")
        refuse_step_that_cannot_train(self.training, self._dropout_ops)
        refuse_evaluation_that_writes(self.training, self._written, "step()")
        with self.autocast.set_aside("step()"):  # the program runs in the plan's precision (``runtime/autocast``)
            return self._scheduled_step(args, local)

    def _scheduled_step(self, args: Sequence[torch.Tensor], local: bool) -> torch.Tensor:
        """``step``'s schedule over checked inputs."""
        weights = self._microbatch_weights(args, local)  # first: it may refuse the step
        names = self.captured.user_inputs
        by_name = dict(zip(names, args))
        self._local_inputs = local
        first = args if self.chunks[0].index == 0 else ()
        later = {n: by_name[n] for chunk in self.chunks if chunk.index > 0 for n in chunk.reads}
        losses: list[torch.Tensor] = []
        for program in self._lowered_programs():  # what a step that failed before its end left there
            program.forget_unfinished_step()
        self._read_parameters(self._program_params.begin_step())
        # reduce each gradient during its last microbatch's backward (filed there once: ``_accumulate_in_leaves``)
        self._program_params.arm(1 if self._leaf_sums else self.microbatches)
        self._reduce_inputs_ahead(first, later)
        self._losses = []
        scale = self.loss_scale.before_backward(list(self.parameters())) if self.loss_scale else 1.0
        self._weights = [w * scale for w in weights]
        with self.randomness.step():
            self.schedule.step(*first, target=torch.arange(self.microbatches), losses=losses, return_outputs=False,
                               **later)
        for program in self._lowered_programs():
            if not program.files_in_last_backward:  # ``_accumulate_in_leaves``
                program.file_leaf_gradients()
        self._program_params.end_step()
        self._tied_sync()  # weights tied across stages: each stage's copy gets the sum of their gradients
        for program in self._lowered_programs():  # the losses' reductions left unwaited in forward (``lower_eager``)
            program.finish()
        if self.loss_scale:  # unscaled, or dropped where a rank's overflowed (the caller's optimizer step skipped)
            self.loss_scale.after_backward(list(self.parameters()), torch.device(self.mesh.device_type))
        scaled = [(loss.detach() * (self._weights[i] / scale)).float() for i, loss in self._losses]
        return self._broadcast_loss(sum(scaled) if scaled else torch.zeros(()))

    def _microbatch_weights(self, args: Sequence[torch.Tensor], local: bool) -> list[float]:
        """Each microbatch's weight in the step's loss (``inputs.microbatch_weights``), on every rank (each computes
        them alike: the refusal below stops every rank's schedule, not only the last stage's)."""
        m = self.microbatches
        pieces = microbatch_pieces(args, m, self._carriers)
        weights = microbatch_weights(self._loss_reduction, pieces, self.plan, self.mesh, self.captured.user_inputs,
                                     local)
        empty = [i for i, weight in enumerate(weights) if weight == 0]
        if empty and len(empty) < m:
            raise BadInputError(
                f"microbatch {empty[0]} of this step ({len(empty)} of {m}) counts none of the targets its loss divides "
                "by (all ignored, as padding): its loss would be 0/0 and make every gradient NaN, and a pipeline "
                "runs every microbatch; give each microbatch a counted target (or plan fewer, larger microbatches)")
        return weights

    def _reduce_inputs_ahead(self, first: Sequence[torch.Tensor], later: Mapping[str, torch.Tensor]) -> None:
        """Start reducing, for every microbatch of the step at once, the sums each eager chunk computes from its
        user inputs, buffers and constants alone (``lower_eager.InputReductions``: a last stage's count of
        targets under data parallelism), before the schedule runs: each forward then reads its microbatch's
        where it waited on its own all_reduce. The microbatches are the schedule's own split of the inputs."""
        split = None
        for chunk in self.chunks:
            eager = getattr(chunk.program, "eager", None)
            reductions = eager.reductions if eager is not None else None
            names = chunk.input_names([eager.positions[i] for i in reductions.reads]) if reductions else None
            if names is None:
                continue
            if split is None:
                split = split_args_kwargs_into_chunks(tuple(first), dict(later), self.microbatches,
                                                      *self._chunk_specs(tuple(later)))
            inputs = {}
            for mb, (args, kwargs) in enumerate(zip(*split)):
                users = dict(zip(self.captured.user_inputs, args)) if chunk.index == 0 else kwargs
                inputs[mb] = [_local(chunk.values[n]) if n in chunk.values
                              else self._user_input(n, users[n], as_local=True) for n in names]
            reductions.launch(inputs)

    def _accumulate_in_leaves(self, plan: Plan) -> None:
        """Let the lowered chunks sum their microbatches' gradients in their parameters' leaves and file each
        sum once, in the step's last backward (``LoweredProgram._leaf``), where nothing needs a gradient
        sooner: not under ZeRO-2 (which reduce-scatters each microbatch's to hold no whole gradient), and
        no parameter read by two chunks of this rank (each would file its own sum as the whole). Only the first
        stage's rank, under data parallelism, files them in its last backward, whose end is the step's end there,
        so that its buckets' all_reduces overlap the rest of that backward. Every other rank files them after its
        schedule (``LoweredProgram.file_leaf_gradients``): its last backward then sends its input gradient, which
        the previous stage waits for, without first storing every parameter's (about 0.4 ms a step of Python on
        the benchmark's GPT stages), and its reductions overlap the previous stages' last backward passes (a
        stage of one rank reduces nothing)."""
        read = [name for chunk in self.chunks for name in chunk.placeholders if name in self.captured.params]
        self._leaf_sums = plan.degrees.zero != 2 and len(read) == len(set(read))
        after_schedule = self._leaf_sums and (self.mesh.size() == 1 or self.pp_rank > 0)
        for chunk in self.chunks:
            chunk.program.accumulates_in_leaves = self._leaf_sums
            chunk.program.files_in_last_backward = not after_schedule

    def _lowered_programs(self) -> list[LoweredProgram]:
        """This rank's chunks' lowered programs (none where the plan runs on DTensor)."""
        return [chunk.program for chunk in self.chunks if isinstance(chunk.program, LoweredProgram)]

    def _read_parameters(self, values: Mapping[str, torch.Tensor]) -> None:
        """Hand each chunk this step's value of every parameter it reads (``ProgramParameters.begin_step``) and the
        float8 casts of its weights made from them (``passes/float8.StepCasts``)."""
        fqn = self.captured.params
        for chunk in self.chunks:
            chunk.values.update({name: values[fqn[name]] for name in chunk.placeholders if name in fqn})
            chunk.values.update(self._step_casts.made_from(chunk.values.__getitem__, chunk.placeholders))

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.reshape(()).clone()
        last_stage_rank = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        dist.broadcast(loss, src=last_stage_rank, group=self.pp_group)
        return loss

    # ---- building -----------------------------------------------------------------------------
    def _deferred_init(self, model: nn.Module, mine: list[Stage], init_weights: InitWeights | None
                       ) -> ShardedInit | None:
        """A meta-device model's tensors that this rank's chunks read, allocated as their shards and initialized
        (``runtime/deferred_init.py``); None for a model with its weights."""
        if not holds_meta_tensors(model):
            return None
        cg, plan = self.captured, self.plan
        read = {name for stage in mine for name in stage.program.placeholders}
        params = {cg.params[n]: plan.placements[cg.params[n]] for n in read if n in cg.params}
        buffers = {cg.buffers[n]: plan.buffers[cg.buffers[n]] for n in read if n in cg.buffers}
        deferred = ShardedInit(model, self.mesh, params, buffers, init_weights)
        deferred.run()
        return deferred

    def _stage_module(self, stage: Stage, model: nn.Module) -> StageModule:
        cg = self.captured
        names = {found[1] for found in map(written_value, stage.program.graph_module.graph.nodes) if found}
        writes = {n: cg.buffers[n] for n in stage.program.placeholders if cg.buffers.get(n) in names}
        return StageModule(stage, self._placeholder_values(stage, model), self._user_input, cg.user_inputs,
                           self.mesh, writes)

    def _placeholder_values(self, stage: Stage, model: nn.Module) -> dict[str, Any]:
        """Parameters (sharded), buffers and constants the chunk reads, by placeholder name."""
        cg, plan = self.captured, self.plan
        named_params, named_buffers = dict(model.named_parameters()), dict(model.named_buffers())
        values: dict[str, Any] = {}
        for name in stage.program.placeholders:
            if name in cg.params:
                fqn = cg.params[name]
                if fqn not in self._sharded:
                    master = as_master(named_params[fqn], plan.precision)
                    self._sharded.update(shard_parameters({fqn: master}, {fqn: plan.placements[fqn]}, self.mesh))
                values[name] = self._sharded[fqn]
            elif name in cg.buffers:
                buffer = in_compute_dtype(named_buffers[cg.buffers[name]], plan.precision)
                values[name] = shard_tensor(buffer, self.mesh, plan.buffers[cg.buffers[name]])
            elif name in cg.constants:
                values[name] = shard_tensor(cg.constants[name], self.mesh, ["R"] * self.mesh.ndim)
        return values

    def _user_input(self, name: str, x: torch.Tensor, as_local: bool = False) -> torch.Tensor:
        """One microbatch of a user input, as this step was given it (global, or with ``local`` a slice), as a
        DTensor, or ``as_local`` as this rank's shard of it (``inputs.user_input_shard``)."""
        made = user_input_shard if as_local else user_input
        return in_compute_dtype(made(self.plan, self.mesh, name, x, self._local_inputs), self.plan.precision)

    def _schedule(self, num_chunks: int) -> Any:
        kind = self.plan.pipeline.schedule
        if kind in ZERO_BUBBLE and kind not in SCHEDULES:
            raise BadInputError(f"pipeline schedule {kind!r} runs as torch's {ZERO_BUBBLE[kind]}, which torch "
                                f"{torch.__version__} does not have: plan again with another schedule")
        if kind not in SCHEDULES:
            raise BadInputError(f"pipeline schedule {kind!r} is not one this runtime runs ({', '.join(SCHEDULES)})")
        device = torch.device(self.mesh.device_type)
        for chunk in self.chunks:  # torch's input-gradient step detaches a chunk's outputs in place: no views
            chunk.copies_outputs = kind in ZERO_BUBBLE
        stages = [AccumulatingStage(chunk, chunk.index, num_chunks, device, group=self.pp_group,
                                input_args=self._example_inputs(chunk),
                                output_args=tuple(b.local_meta(self.mesh) for b in chunk.outputs))
                  for chunk in self.chunks]
        m = self.microbatches
        later = [n for chunk in self.chunks if chunk.index > 0 for n in chunk.reads]  # as ``step`` passes them
        args_spec, kwargs_spec = self._chunk_specs(tuple(dict.fromkeys(later)))
        if kind in MULTI_CHUNK_SCHEDULES:
            return SCHEDULES[kind](stages, m, loss_fn=self._scaled_loss, args_chunk_spec=args_spec,
                                   kwargs_chunk_spec=kwargs_spec, scale_grads=False)
        (stage,) = stages
        return SCHEDULES[kind](stage, m, loss_fn=self._scaled_loss, args_chunk_spec=args_spec,
                               kwargs_chunk_spec=kwargs_spec, scale_grads=False)

    def _chunk_specs(self, later: Sequence[str]) -> tuple[tuple[Any, ...] | None, dict[str, Any]]:
        """How the schedule cuts the first chunk's inputs (positional; None on a rank without it) and the user
        inputs later chunks read (``later``, keyword) into microbatches (``pipeline_chunk_spec``)."""
        spec = lambda name: pipeline_chunk_spec(carries_batch(self.plan, name))  # noqa: E731
        first = tuple(spec(n) for n in self.captured.user_inputs) if self.chunks[0].index == 0 else None
        return first, {n: spec(n) for n in later}

    def _scaled_loss(self, loss: torch.Tensor, microbatch: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn``: the last chunk computed the loss of microbatch ``microbatch`` (its
        index, the schedule's target), which backward takes weighted (``_microbatch_weights``). Its value is
        read after the schedule from the loss itself, kept here: a lowered chunk may write it there only then
        (``EagerForward.finish``)."""
        index = int(microbatch)
        self._losses.append((index, loss))
        return loss * self._weights[index]

    def _example_inputs(self, chunk: StageModule) -> tuple[torch.Tensor, ...]:
        if chunk.index > 0:
            return tuple(b.local_meta(self.mesh) for b in chunk.inputs)
        return tuple(torch.empty(microbatch_shape(self.plan, n, self.microbatches),
                                 dtype=getattr(torch, self.plan.inputs[n]["dtype"]), device="meta")
                     for n in self.captured.user_inputs)

    # ---- checkpoints (runtime/checkpoint.py) ---------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, DTensor]:
        """This rank's stages' FQN -> DTensor of global shape (parameters as ``named_parameters()``,
        persistent buffers), sharing storage: ``dcp.save`` writes each key once, and any plan's
        ``dcp.load`` finds every key it holds."""
        buffers = [(self.captured.buffers[n], v) for chunk in self.chunks for n, v in chunk.values.items()
                   if n in self.captured.buffers]
        return module_state_dict([*self.named_parameters(), *buffers], self._state_names)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
                        ) -> None:
        """Copy FQN -> full tensor or DTensor (any placement) into this rank's stages' shards; other
        stages' keys are skipped (``strict`` refuses only keys the model does not have)."""
        load_module_state_dict(self.state_dict(), state_dict, self._state_names, strict)


def _local(value: Any) -> Any:
    """A DTensor's local tensor; anything else as it is."""
    return value._local_tensor if isinstance(value, DTensor) else value


def pipeline_meshes(plan: Plan, device_type: str | None = None) -> tuple[DeviceMesh, DeviceMesh]:
    """The world mesh ``pp x (stage mesh)`` and this rank's stage submesh (the plan's mesh)."""
    if not dist.is_initialized():
        raise BadInputError("autoparallelize needs an initialized process group: run under torchrun, "
                            "or call torch.distributed.init_process_group first")
    pp, names = plan.degrees.pp, tuple(plan.mesh.dim_names)
    shape = (pp, *plan.mesh.shape)
    world = dist.get_world_size()
    if int(torch.tensor(shape).prod()) != world:
        raise BadInputError(f"the plan's pipeline of {pp} stages of mesh {list(plan.mesh.shape)} needs "
                            f"{int(torch.tensor(shape).prod())} ranks, this job has {world}")
    device_type = device_type or job_device_type()
    world_mesh = init_job_mesh(device_type, shape, ("pp", *names))
    return world_mesh, world_mesh[names if len(names) > 1 else names[0]]
