"""A user input made the DTensor a program reads (``autopar.runtime.inputs.user_input``), on 2 fake ranks."""

from __future__ import annotations

import torch

import autopar
from autopar.models import build_model


def test_each_program_reads_its_inputs_on_its_own_mesh_with_a_spec_made_once(two_fake_ranks) -> None:
    """A user input's spec is made once per mesh and reused step after step; two programs of one process on
    meshes equal by value (the benchmark's and the tests' case) each get specs holding their own mesh object,
    as DTensor's constructors would give them, and the rank's shard of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.inputs import user_input

    bundle = build_model("tiny-gpt", global_batch=8, device="cpu")
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn,
                        {"dp": 2, "fsdp": 0, "microbatches": 1}, example_targets=bundle.example_targets)
    (name, _), (x,) = next(iter(plan.inputs.items())), bundle.example_inputs
    meshes = [init_device_mesh("cpu", tuple(plan.mesh.shape), mesh_dim_names=tuple(plan.mesh.dim_names))
              for _ in range(2)]
    assert meshes[0] == meshes[1] and meshes[0] is not meshes[1]
    made = [[user_input(plan, mesh, name, x, False) for _ in range(2)] for mesh in meshes]
    for mesh, (first, again) in zip(meshes, made):
        assert first._spec.mesh is mesh and again._spec is first._spec
        assert torch.equal(first.to_local(), x.chunk(2)[0])  # rank 0's rows of the batch split on dp
