"""Rewrite passes: from a Plan, the per-rank program (docs/architecture.md "Layers").

One pass per file, each named for what it does; ``build_program`` applies them in order:

1. ``shard_parameters``: every parameter and buffer becomes a DTensor with the plan's placements;
2. ``insert_redistributes``: before each op, inputs are moved to the placements the plan chose for
   that op (DTensor ``redistribute``, whose collectives are differentiable, so backward communication
   falls out of autograd);
3. ``run_locally``: ops DTensor cannot dispatch (no strategy, or planned with one of autopar's own
   local rules such as fused attention split on heads) run on local shards;
4. ``reshard``: parameters gathered for an op are gathered again in backward instead of held from
   forward to backward (FSDP's reshard after forward); the program runs under its saved-tensor hooks;
5. ``checkpoint``: each repeated layer the plan recomputes becomes a submodule run under
   ``torch.utils.checkpoint`` (full or selective recomputation, per layer);
6. ``gradient_sync`` (after backward): partial gradients are all-reduced in buckets;
7. ``zero`` (ZeRO-1/2 plans): the optimizer gets dp-sharded copies of the parameters, gradients are
   reduce-scattered onto them and parameters all-gathered from them before each step.

Passes read a Plan, never the solver.
"""

from .checkpoint import checkpoint_layers
from .gradient_sync import GradientSync
from .insert_redistributes import insert_redistributes
from .reshard import ResavedParameters, reshard_after_forward
from .run_locally import run_locally
from .shard_parameters import shard_parameters, shard_tensor
from .zero import ShardedOptimizerState

__all__ = ["GradientSync", "ResavedParameters", "ShardedOptimizerState", "checkpoint_layers", "insert_redistributes",
           "reshard_after_forward", "run_locally", "shard_parameters", "shard_tensor"]
