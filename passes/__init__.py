"""Rewrite passes: from a Plan, the per-rank program (docs/architecture.md "Layers").

One pass per file, each named for what it does. ``build_program`` (``program.py``) is the one ordered
list of graph passes; every runtime runs the stage programs it returns:

0. ``retarget_devices``: ops that make tensors from nothing do so on the mesh's device, not the one the
   step was captured on (a meta-device model's capture, a CPU model's for a GPU job);
1. ``insert_redistributes``: before each op, inputs are moved to the placements the plan chose for
   that op (DTensor ``redistribute``, whose collectives are differentiable, so backward communication
   falls out of autograd); under context parallelism's load-balanced layout ``sequence_layout``
   (``balance_sequence``) reorders the sequence around each move that splits or gathers it over cp;
2. ``reshard``: parameters gathered for an op are gathered again in backward instead of held from
   forward to backward (FSDP's reshard after forward);
3. ``mixed_precision``: under a mixed-precision plan, every op reading a parameter reads it cast to the
   compute dtype, and a gathered parameter is cast before it is gathered (``cast_parameters``);
4. ``run_locally``: (after ``dropout_mode``, which makes the program's dropout read the module's mode, off
   under ``pm.eval()``) ops DTensor cannot dispatch (no strategy, or planned with one of autopar's own
   local rules such as fused attention split on heads, or on its queries under context parallelism,
   and the views that flatten a context-parallel sequence into rows) run on local shards; then the
   backward passes DTensor cannot run are mended: reshaping views' gradients are laid out as their specs say
   (``layout.guard_view_gradients``), and ``copy`` and ``slice_scatter`` get derivatives that run there
   (``dtensor_backward``);
5. ``rematerialize``: the cheap pointwise values autograd would keep that ``ir/rematerialize.py`` names
   (``SavedTensors.recomputed``: SwiGLU's, a norm's), and the moves of activations to a larger placement
   that a reader keeps (``regathered_moves``: sequence parallelism's gathered norm outputs, context
   parallelism's gathered keys and values), run through ``Remembered``, made again in backward
   rather than kept (``Rematerialized``' saved-tensor hooks around the stage program, inside
   ``ResavedParameters``' when both run);
6. ``split_stages``: a pipeline plan's program is cut into its chunks' stage programs; any other
   plan's is one stage program, the whole program;
7. ``checkpoint``: in each stage program, each repeated layer the plan recomputes becomes a submodule
   run under ``torch.utils.checkpoint`` (full or a selective policy, per layer), or, under core_attention,
   each of its attention cores does; when step 2
   rewrote a gather, the stage program runs under ``reshard.ResavedParameters``' saved-tensor hooks.

Passes acting outside the graph, on the runtime's parameters and gradients, are applied by
``mixed_precision.ProgramParameters`` (both runtimes use it) in this order:

a. ``shard_parameters`` (building): every parameter and buffer becomes a DTensor with the plan's
   placements (the pipeline runtime shards only its own stages'), in fp32 under mixed precision (the
   optimizer's master weights);
b. ``zero`` (ZeRO-1/2 plans, ``ParallelModule``; building): ``ShardedOptimizerState`` gives the
   optimizer dp- (and cp-) sharded copies of the parameters, and before a step's first forward gathers the
   program's parameters from them;
c. ``gradient_sync`` (after backward): partial gradients of the parameters ZeRO leaves whole are
   all-reduced in buckets (``ParallelModule`` arms it before the last microbatch's backward, the
   pipeline runtime for ``m`` accumulations before its schedule: either way each bucket's all_reduce
   overlaps the last microbatch's backward);
d. ``zero`` again (after backward): gradients are reduce-scattered onto the optimizer's shards (ZeRO-2
   during backward already, ZeRO-1 here);
e. ``tied_parameters`` (pipeline plans, after backward): a weight read by several stages (a tied
   embedding) has a copy on each, whose gradients are all-reduced between those stages' ranks.

Passes read a Plan, never the solver.
"""

from .gradient_sync import GradientSync
from .mixed_precision import ProgramParameters
from .program import Program, Stage, build_program
from .shard_parameters import shard_parameters, shard_tensor
from .zero import ShardedOptimizerState

__all__ = ["GradientSync", "Program", "ProgramParameters", "ShardedOptimizerState", "Stage", "build_program", "shard_parameters",
           "shard_tensor"]
