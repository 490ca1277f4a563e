"""Mixed precision: bf16 compute copies of fp32 master weights, a chosen reduction dtype, in the plan, the
cost model and the runtime (``passes/mixed_precision.py``, ``core.plan.Precision``)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from cli_runner import run_cli
import autopar
from autopar.core.constraints import Constraints
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.core.plan import Plan, Precision
from autopar.models import build_model
from autopar.cost_models import parse_cluster
from autopar.planning.pricing import Pricer
from autopar.testing.parity import BF16, train_parallel_many, train_single

STEPS = 3
BATCH = 8
RUNS_ON_2 = [{"dp": 2}, {"dp": 2, "reduce_dtype": "bf16", "microbatches": 2}, {"dp": 2, "fsdp": 3},
             {"tp": 2}, {"dp": 2, "fsdp": 2, "microbatches": 2}, {"pp": 2}]
"""DDP (fp32 and bf16 reductions), FSDP, tensor parallelism, ZeRO-2 and a pipeline, each in bf16."""


@contextmanager
def doubled_master_gradients() -> Iterator[None]:
    """Every master weight's gradient after the step, 1.25x: what a wrong cast or scale would do."""
    from autopar.passes import ProgramParameters

    end_step = ProgramParameters.end_step

    def scaled(self: ProgramParameters) -> None:
        end_step(self)
        for p in self.optimizer_parameters().values():
            if p.grad is not None:
                p.grad = p.grad * 1.25

    ProgramParameters.end_step = scaled
    try:
        yield
    finally:
        ProgramParameters.end_step = end_step


def _run(constraints: dict, **extra) -> dict:
    return dict(name="tiny-gpt", overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                constraints={**constraints, "dtype": "bf16"}, **extra)


@pytest.fixture(scope="module")
def bf16_runs():
    return train_parallel_many(2, [_run(c) for c in RUNS_ON_2] + [_run({"dp": 2}, under=doubled_master_gradients)])


@pytest.fixture(scope="module")
def references():
    return (train_single("tiny-gpt", None, BATCH, None, STEPS, dtype="bf16"),
            train_single("tiny-gpt", None, BATCH, None, STEPS))


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_plans_match_mixed_precision_done_by_hand(bf16_runs, references) -> None:
    """Every composition trains like the single-process mixed-precision reference (fp32 masters, the
    step on bf16 copies): gradients after the first backward, losses and final parameters."""
    mixed, _ = references
    for result, constraints in zip(bf16_runs, RUNS_ON_2):
        assert result.plan["precision"] == {"compute": "bf16", "master": "fp32",
                                             "reduce": constraints.get("reduce_dtype", "fp32")}
        assert result.tolerances == BF16
        result.assert_matches(mixed)


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_runs_compute_in_bf16_and_keep_fp32_masters(bf16_runs, references) -> None:
    """The loss of a one-microbatch step is a bf16 number (the program computes in bf16), unlike the fp32
    run's; the optimizer's parameters, and so the checkpointed and final weights, stay fp32."""
    _, full = references
    for result in bf16_runs[:len(RUNS_ON_2)]:
        losses = [loss for rank in result.losses for loss in rank]
        if result.plan["pipeline"]["microbatches"] == 1:  # else the mean of several, summed in fp32
            assert all(float(torch.tensor(loss).bfloat16()) == loss for loss in losses)
        assert {p.dtype for p in result.params.values()} == {torch.float32}
        assert {g.dtype for g in result.grads.values()} == {torch.float32}
    assert not all(float(torch.tensor(loss).bfloat16()) == loss for loss in full.losses)


@pytest.mark.dist
@pytest.mark.slow
def test_a_wrongly_scaled_gradient_fails_the_bf16_check(bf16_runs, references) -> None:
    mixed, _ = references
    with pytest.raises(AssertionError, match=r"gradients after the first backward: \d+ of \d+ off"):
        bf16_runs[-1].assert_matches(mixed)


def _pricer(zero_stage: int = 0, reduce_dtype: str = "fp32", dtype: str = "bf16") -> Pricer:
    return Pricer(parse_cluster("1x8xH100"), (8,), dtype, zero_stage=zero_stage, zero_dims=(0,),
                  reduce_dtype=reduce_dtype)


def test_parameter_memory_counts_masters_copies_and_fp32_gradients() -> None:
    """Per parameter: 18 bytes under bf16 DDP (2 copy + 4 fp32 gradient + 12 master and moments), 16
    in fp32; ZeRO-1 keeps a bf16 whole parameter and gradient and 12/8 of state; ZeRO-2 only the fp32
    shard's gradient; FSDP divides everything by the shards."""
    weight = torch.empty(64, 64, device="meta")
    numel = weight.numel()
    replicated, sharded = (Replicate(),), (Shard(0),)
    assert _pricer().parameter_memory(weight, replicated) == {"params": 2 * numel, "grads": 4 * numel,
                                                              "optimizer": 12 * numel}
    assert sum(_pricer(dtype="fp32").parameter_memory(weight, replicated).values()) == 16 * numel
    assert _pricer(zero_stage=1).parameter_memory(weight, replicated) == {
        "params": 2 * numel, "grads": 2 * numel, "optimizer": 12 * numel / 8}
    assert _pricer(zero_stage=2).parameter_memory(weight, replicated)["grads"] == 4 * numel / 8
    assert sum(_pricer().parameter_memory(weight, sharded).values()) == 18 * numel / 8


def test_reduce_dtype_halves_the_gradient_all_reduce_and_is_written_in_the_plan(tmp_path) -> None:
    """``--fix reduce_dtype=bf16`` prices data parallelism's all_reduce at half the bytes of fp32's."""
    def plan(reduce_dtype: str) -> dict:
        out = run_cli("plan", "llama3-8b", "--cluster", "2x8xH100", "--global-batch", "16", "--seq", "1024",
                      "--set", "layers=2", "--fix", f"dp=16,fsdp=0,reduce_dtype={reduce_dtype}", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    fp32, bf16 = plan("fp32"), plan("bf16")
    assert fp32["precision"] == {"compute": "bf16", "master": "fp32", "reduce": "fp32"}
    assert bf16["precision"]["reduce"] == "bf16"
    assert bf16["predicted"]["grad_sync_s"] == pytest.approx(fp32["predicted"]["grad_sync_s"] / 2, rel=0.05)
    assert fp32["predicted"]["memory_bytes"] == bf16["predicted"]["memory_bytes"]


def test_a_plan_without_a_precision_section_reads_as_its_model_dtype() -> None:
    """Plans written before mixed precision: ``model.dtype`` computes, masters and reductions in fp32."""
    bundle = build_model("mlp", global_batch=4, device="meta")
    data = autopar.plan(bundle.model, bundle.example_inputs, cluster="1x2xH100", loss_fn=bundle.loss_fn,
                        example_targets=bundle.example_targets).to_dict()
    del data["precision"]
    assert Plan.from_dict(data).precision == Precision.of(data["model"]["dtype"])
    data["precision"] = {"compute": "bf16", "master": "fp32", "reduce": "int8"}
    with pytest.raises(PlanFormatError, match="precision.reduce must be one of fp32, bf16, fp16"):
        Plan.from_dict(data)


def test_a_bad_reduce_dtype_is_refused() -> None:
    with pytest.raises(BadInputError, match="reduce_dtype"):
        Constraints.from_mapping({"reduce_dtype": "int8"})


def test_gradient_sync_reduces_in_the_reduce_dtype_and_returns_fp32(two_fake_ranks: None) -> None:
    """A bucket of fp32 gradients is all-reduced as bf16 and handed back in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autopar.passes import GradientSync

    seen: list[torch.dtype] = []
    all_reduce = dist.all_reduce
    try:
        dist.all_reduce = lambda t, *a, **k: (seen.append(t.dtype), all_reduce(t, *a, **k))[1]
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Replicate()]))
        sync = GradientSync([weight], reduce_dtype=torch.bfloat16)
        x = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        (x @ weight).sum().backward()
        sync()
        assert seen == [torch.bfloat16]
        assert weight.grad.dtype == torch.float32 and weight.grad.placements == (Replicate(),)
    finally:
        dist.all_reduce = all_reduce


DTYPE_CASES = [
    ({"dp": 2, "fsdp": 3}, {"all_gather": ["bfloat16"]}, {"reduce_scatter": "float32"}),
    ({"dp": 2, "fsdp": 3, "reduce_dtype": "bf16"}, {"all_gather": ["bfloat16"], "reduce_scatter": ["bfloat16"]}, {}),
    ({"dp": 2, "fsdp": 0, "reduce_dtype": "bf16"}, {"all_reduce": ["bfloat16"]}, {}),
    ({"dp": 2, "fsdp": 1}, {"all_gather": ["bfloat16"], "reduce_scatter": ["float32"]}, {}),
]
"""(constraints, the floating-point dtypes each kind of collective moved exactly, a dtype it moved among others)."""


def _collective_dtypes_rank(rank: int, world: int, cases: list[dict]) -> list[dict[str, list[str]]]:
    from autopar.api import autoparallelize
    from autopar.testing.counters import CollectiveCounter
    from autopar.testing.parity import batches

    seen = []
    for constraints in cases:
        bundle = build_model("tiny-gpt", global_batch=BATCH, device="cpu", seed=0)
        pm = autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                             example_targets=bundle.example_targets, constraints={**constraints, "dtype": "bf16"})
        with CollectiveCounter() as counter:
            pm.step(*batches(bundle, 1, 0)[0])
        params = dict(bundle.model.named_parameters())
        assert {t.dtype for fqn, t in pm.state_dict().items() if fqn in params} == {torch.float32}  # masters
        seen.append({kind: sorted(str(d).removeprefix("torch.") for d in dtypes if d.is_floating_point)
                     for kind, dtypes in counter.dtypes.items()})
    return seen


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_collectives_move_the_planned_dtypes() -> None:
    """FSDP gathers bf16 shards and reduce-scatters parameter gradients in the reduction dtype (FSDP2's
    mixed precision; with fp32 reductions an activation's reduce_scatter still moves bf16: tiny-gpt's
    position embedding, sharded on dp, is looked up as partial sums); DDP all-reduces in the reduction
    dtype; ZeRO-1 gathers the updated bf16 parameters and reduce-scatters in fp32. The checkpointed
    parameters are the fp32 masters. Floating-point data only: a boolean mask may be gathered too."""
    from autopar.testing.launch import run_on_ranks

    per_case = run_on_ranks(_collective_dtypes_rank, 2, [c for c, _, _ in DTYPE_CASES])[0]
    for (constraints, exactly, among), seen in zip(DTYPE_CASES, per_case):
        assert {kind: seen[kind] for kind in exactly} == exactly, constraints
        assert all(dtype in seen[kind] for kind, dtype in among.items()), constraints


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_bf16_inside_pipeline_stages_and_on_2d_meshes_matches_by_hand() -> None:
    """4 ranks: FSDP and ZeRO-1 (with bf16 reductions) inside two pipeline stages, FSDP x TP."""
    cases = [{"pp": 2, "dp": 2, "fsdp": 3}, {"pp": 2, "dp": 2, "fsdp": 1, "reduce_dtype": "bf16"},
             {"dp": 2, "tp": 2, "fsdp": 3}]
    runs = [dict(name="tiny-llama", overrides=None, global_batch=BATCH, seq=None, steps=STEPS, plan=None,
                 constraints={**c, "dtype": "bf16"}) for c in cases]
    mixed = train_single("tiny-llama", None, BATCH, None, STEPS, dtype="bf16")
    for case, result in zip(cases, train_parallel_many(4, runs)):
        assert result.plan["degrees"]["pp"] == case.get("pp", 1)
        result.assert_matches(mixed)


def test_export_gives_fsdp_the_plans_mixed_precision_policy() -> None:
    """Exporting a bf16 FSDP plan writes FSDP2's ``MixedPrecisionPolicy`` with the plan's dtypes; a DDP
    plan, which native PyTorch cannot give fp32 masters, says so in a note."""
    from autopar.inspect.export import export_plan

    bundle = build_model("tiny-gpt", global_batch=8, device="meta")

    def export(constraints: dict) -> tuple[str, list[str]]:
        plan = autopar.plan(bundle.model, bundle.example_inputs, cluster="1x2xH100", loss_fn=bundle.loss_fn,
                            example_targets=bundle.example_targets, constraints=constraints)
        return export_plan(plan)

    fsdp, _ = export({"dp": 2, "fsdp": 3, "reduce_dtype": "bf16"})
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)" in fsdp
    assert "mp_policy=policy" in fsdp
    ddp, notes = export({"dp": 2, "fsdp": 0})
    assert "MixedPrecisionPolicy" not in ddp and any("mixed precision (bf16 compute" in n for n in notes)


HF_RUNS_IN_BF16 = {"gpt2-fsdp": ("gpt2", {"mask": True}, {"dp": 2, "fsdp": 3}),
                   "llama-tp": ("llama", {"own_loss": True}, {"tp": 2}),
                   "vit-bf16-reductions": ("vit", {"own_loss": True}, {"dp": 2, "reduce_dtype": "bf16"}),
                   "gpt2-pp": ("gpt2", {"mask": True}, {"pp": 2})}
"""Hugging Face models as they come, in bf16: GPT-2 with a mask and its tied embedding under FSDP and
across two pipeline stages, Llama returning its own loss under tensor parallelism, ViT (float inputs,
cast on their way in) with bf16 gradient reductions."""


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:autopar. no DTensor sharding strategy")
@pytest.mark.parametrize("runs", [["gpt2-fsdp"], pytest.param(["llama-tp", "vit-bf16-reductions", "gpt2-pp"],
                                                                marks=pytest.mark.extended)],
                         ids=["gpt2-fsdp", "llama-tp-vit-gpt2-pp"])
def test_hugging_face_models_train_in_bf16_like_mixed_precision_done_by_hand(runs: list[str]) -> None:
    """``HF_RUNS_IN_BF16``: GPT-2 under FSDP in the default tier, the others (one spawn) in the extended tier."""
    pytest.importorskip("transformers")
    specs = [dict(name=f"autopar.models.hf:{family}", overrides=overrides, global_batch=BATCH, seq=None,
                  steps=STEPS, plan=None, constraints={**constraints, "dtype": "bf16"})
             for family, overrides, constraints in (HF_RUNS_IN_BF16[run] for run in runs)]
    for spec, result in zip(specs, train_parallel_many(2, specs)):
        result.assert_matches(train_single(spec["name"], spec["overrides"], BATCH, None, STEPS, dtype="bf16"))
