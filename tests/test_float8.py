"""Float8 linears (``--fix fp8=tensorwise``): which ops run in float8 (``ir/float8.py``), how they compute
(``passes/float8.py``), how they are priced (``planning/pricing.py``), shown and refused, and that a float8
plan trains on gloo as one process running the same float8 linears does."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from torch import fx

from cli_runner import run_cli
import autopar
from torch.distributed.tensor import Replicate, Shard

from autopar.core.axes import MeshAxis
from autopar.core.constraints import Constraints
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.core.plan import Plan
from autopar.cost_models import parse_cluster
from autopar.ir.capture import capture, module_path, view_root
from autopar.ir.float8 import float8_linears, float8_weights, reused_casts
from autopar.models import build_model
from autopar.passes import float8 as f8
from autopar.passes.program import copy_graph
from autopar.planning.meshes import MeshChoice
from autopar.planning.roles import pricer_for
from autopar.planning.strategies import Strategy
from autopar.inspect.collectives import predicted_collectives
from autopar.testing.counters import as_run_on_gloo, counted_step
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import FP8, build, train_parallel_many, train_single


E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _by_hand(x: torch.Tensor, top: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` at the tensorwise scale ``top / amax``, and scaled back."""
    scale = top / x.abs().max()
    return (x * scale).clamp(-top, top).to(dtype).to(torch.float32) / scale


def test_a_float8_matmul_multiplies_e4m3_operands_and_takes_its_gradients_from_an_e5m2_one() -> None:
    torch.manual_seed(0)
    a, b, grad = torch.randn(32, 48, requires_grad=True), torch.randn(48, 16, requires_grad=True), torch.randn(32, 16)
    out = f8.float8_mm(a, b)
    out.backward(grad)
    qa, qb = _by_hand(a.detach(), E4M3_MAX, torch.float8_e4m3fn), _by_hand(b.detach(), E4M3_MAX, torch.float8_e4m3fn)
    qg = _by_hand(grad, E5M2_MAX, torch.float8_e5m2)
    torch.testing.assert_close(out, qa @ qb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad, qg @ qb.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, qa.t() @ qg, rtol=1e-5, atol=1e-5)
    assert (out - a.detach() @ b.detach()).abs().max() > 1e-3  # it did round: three mantissa bits


def test_an_all_zero_operand_scales_by_a_finite_number() -> None:
    out = f8.float8_mm(torch.zeros(16, 16), torch.randn(16, 16))
    assert torch.equal(out, torch.zeros(16, 16))


def _captured(name: str, **overrides):
    bundle = build(name, overrides or None, 8, None, 0)
    return capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)


def test_float8_takes_the_layers_linears_and_leaves_the_head_and_a_narrow_router() -> None:
    captured = _captured("tiny-moe")
    paths = {module_path(captured.node(name)).split(".", 2)[-1] for name in float8_linears(captured)}
    assert paths == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"}  # the experts are bmm
    left = {module_path(n) for n in captured.graph.nodes if n.op == "call_function" and "mm" in n.name
            and n.name not in float8_linears(captured)}
    assert {"lm_head", "blocks.0.moe.router"} <= left  # outside the layers; 4 experts wide
    assert float8_weights(captured) == {f"blocks.{i}.attn.{p}.weight" for i in range(2)
                                        for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    bundle = build("tiny-moe", None, 8, None, 0)
    made = autopar.float8_eager(bundle.model, bundle.example_inputs, bundle.loss_fn,
                                example_targets=bundle.example_targets)
    assert {f"{name}.weight" for name in made} == float8_weights(captured)


def _plan(args: str) -> dict:
    result = run_cli("plan", *args.split(), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_float8_plan_prices_the_linears_at_the_fp8_rate_and_says_so(tmp_path) -> None:
    common = "llama3-8b --cluster 1x8xH100 --global-batch 16 --seq 4096 --fix dp=8,fsdp=3,microbatches=2"
    plain, fp8 = _plan(common), _plan(common + ",fp8=tensorwise")
    assert plain["degrees"] == fp8["degrees"] and "fp8" not in plain["precision"]
    assert fp8["precision"] == {"compute": "bf16", "master": "fp32", "reduce": "fp32", "fp8": "tensorwise"}
    assert 0.7 * plain["predicted"]["compute_s"] < fp8["predicted"]["compute_s"] < 0.9 * plain["predicted"]["compute_s"]
    assert fp8["predicted"]["comm_s"]["all_reduce"] > plain["predicted"]["comm_s"]["all_reduce"]  # the amaxes
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(fp8))
    assert Plan.load(path).precision.fp8 == "tensorwise"
    shown = run_cli("show", str(path)).stdout
    assert ("linear layers in float8 (tensorwise scaling: e4m3 forward, e5m2 gradients), each weight read as stored "
            "cast once a step") in shown


def test_a_float8_linear_reduces_the_amax_of_each_split_operand_once_a_microbatch() -> None:
    """A query projection under data parallelism over one node of 8: the activation and the output split
    on the batch, the weight whole, so one all_reduce of an fp32 amax forward (the activation's) and one
    backward (the output gradient's), each ``base + 14 alpha`` on the NVLink ring, four times with four
    microbatches; a plain pricer charges none."""
    captured = _captured("tiny-llama")
    node = next(captured.node(n) for n in sorted(float8_linears(captured)) if "q_proj" in module_path(captured.node(n)))
    kinds = [captured.gradient_kinds()[a.name] for a in node.all_input_nodes]
    split = Strategy(inputs=((Shard(0),), (Replicate(),)), outputs=((Shard(0),),))
    mesh, cluster = MeshChoice(((MeshAxis.DP_SHARD, 8),), 1), parse_cluster("1x8xH100")
    fp8 = pricer_for(cluster, mesh, "bf16", Constraints.parse("fp8=tensorwise"), captured)
    plain = pricer_for(cluster, mesh, "bf16", Constraints())
    cost, plain_cost = fp8.node(node, split, kinds, [1.0]), plain.node(node, split, kinds, [1.0])
    group = fp8.groups[0]
    one = group.base_latency_s + 14 * group.intra_latency_s + 14 / 8 * 4 / group.intra_bw
    assert cost.comm_s["all_reduce"] == pytest.approx(2 * one, rel=1e-9) and "all_reduce" not in plain_cost.comm_s
    assert cost.forward_comm_s["all_reduce"] == pytest.approx(one, rel=1e-9)
    assert fp8.for_microbatches(cost, 4).comm_s["all_reduce"] == pytest.approx(8 * one, rel=1e-9)
    assert cost.kernel.float8 is not None and plain_cost.kernel.float8 is None


def test_linears_reading_one_input_cast_it_once_and_are_priced_so() -> None:
    """q, k and v read one normed input, w1 and w3 another, each through its own view: the program makes them
    read one view, the first casts it (one amax, one e4m3 copy) and the others read that cast; the pricer
    charges the others no activation amax, cast or all_reduce (a query, key or value projection under
    data parallelism over 8: the key's forward all_reduce is its weight's alone, which is whole: none)."""
    captured = _captured("tiny-llama")
    reused = reused_casts(captured)
    projections = {module_path(captured.node(n)).rsplit(".", 1)[-1] for n in reused}
    assert projections == {"k_proj", "v_proj", "w3"} and len(reused) == 3 * 2  # two layers
    key = next(captured.node(n) for n in sorted(reused) if "k_proj" in module_path(captured.node(n)))
    kinds = [captured.gradient_kinds()[a.name] for a in key.all_input_nodes]
    split = Strategy(inputs=((Shard(0),), (Replicate(),)), outputs=((Shard(0),),))
    mesh, cluster = MeshChoice(((MeshAxis.DP_SHARD, 8),), 1), parse_cluster("1x8xH100")
    fp8 = pricer_for(cluster, mesh, "bf16", Constraints.parse("fp8=tensorwise"), captured)
    assert [c.phase for c in fp8.amax_collectives(key, split)] == ["backward"]
    cost = fp8.node(key, split, kinds, [1.0])
    assert not cost.kernel.float8.casts_activation and cost.forward_comm_s.get("all_reduce", 0.0) == 0.0
    program = fx.GraphModule(captured.graph_module, copy_graph(captured.graph))
    linears = float8_linears(captured)
    assert f8.run_in_float8(program, linears, captured.gradient_kinds()) == len(linears)
    nodes = {n.name: n for n in program.graph.nodes}
    attention = [nodes[n] for n in sorted(float8_linears(captured))
                 if module_path(captured.node(n)).startswith("blocks.0.attn.") and "o_proj" not in
                 module_path(captured.node(n))]
    assert len(attention) == 3 and len({n.args[0] for n in attention}) == 1  # one view of the normed input


def test_a_float8_linear_keeps_its_input_as_its_float8_copy_not_as_the_value_it_read() -> None:
    """The MLP's down projection alone reads the gated product: a plain matmul keeps it for its weight's
    gradient as the projections it is made of (made again in backward, ``ir/rematerialize.py``), a float8
    linear a one-byte e4m3 copy of it, charged to the product's producer as one copy; the weight is kept by
    both."""
    captured = _captured("tiny-llama")
    down = next(captured.node(n) for n in float8_linears(captured) if "w2" in module_path(captured.node(n)))
    product, weight = view_root(down.args[0]), view_root(down.args[1])
    plain, fp8 = captured.saved_for_backward(), captured.saved_for_backward(float8_linears(captured))
    assert plain.of(product)[0] == fp8.of(product)[0] == 0.0
    assert product.name in plain.recomputed and product.name not in fp8.recomputed
    assert plain.copies_of(product)[0] == 0.0 and fp8.copies_of(product)[0] == 1.0
    norm = view_root(next(captured.node(n) for n in float8_linears(captured)
                          if "q_proj" in module_path(captured.node(n))).args[0])
    assert fp8.copies_of(norm)[0] == 1.0  # q, k and v keep one (``passes/float8.cast_once``)
    assert weight.name in captured.params
    assert (down.name, weight.name) in plain.parameters_kept and (down.name, weight.name) in fp8.parameters_kept


def test_a_float8_weight_is_cast_once_a_step_and_each_microbatch_where_it_is_gathered() -> None:
    """A query projection under data parallelism over 8 with 4 microbatches: its weight, read whole as it is
    stored, is cast once a step (an amax and a cast forward, none in backward) and its e4m3 copy, one byte an
    element, is the parameter's; gathered from a dp-shard (FSDP), it is cast as it arrives in every
    microbatch's forward and again in each backward, the difference the solver adds with the placement."""
    captured = _captured("tiny-llama")
    node = next(captured.node(n) for n in sorted(float8_linears(captured)) if "q_proj" in module_path(captured.node(n)))
    kinds = [captured.gradient_kinds()[a.name] for a in node.all_input_nodes]
    split = Strategy(inputs=((Shard(0),), (Replicate(),)), outputs=((Shard(0),),))
    fp8 = pricer_for(parse_cluster("1x8xH100"), MeshChoice(((MeshAxis.DP_SHARD, 8),), 1), "bf16",
                     Constraints.parse("fp8=tensorwise"), captured)
    kernel = fp8.node(node, split, kinds, [1.0]).kernel
    forward, backward = fp8._weight_cast_time(kernel.float8)
    weightless = kernel._replace(float8=kernel.float8._replace(weight=0.0))
    for m in (1, 4):  # the weight's share of the scaling kernels, the same whatever the microbatches
        weights = [fp8._scaling_time(k, m, forward=True) for k in (kernel, weightless)]
        assert weights[0] - weights[1] == pytest.approx(forward - fp8._weight_cast_time(weightless.float8)[0])
        assert fp8._scaling_time(kernel, m, forward=False) == fp8._scaling_time(weightless, m, forward=False)
    assert fp8.recast_root_delta(node, split, kinds, 1, (Replicate(),)) is None  # read as stored
    assert fp8.recast_root_delta(node, split, kinds, 0, (Shard(0),)) is None  # not the weight
    gathered = fp8.for_microbatches(fp8.recast_root_delta(node, split, kinds, 1, (Shard(0),)), 4)
    assert gathered.compute_s == pytest.approx(4 * backward + 3 * forward, rel=1e-12)
    weight = view_root(node.args[1])
    assert weight.name in fp8.float8_weights
    val = weight.meta["val"]
    whole = (Replicate(),)
    assert fp8.parameter_memory(val, whole, float8=True)["params"] - fp8.parameter_memory(val, whole)["params"] \
        == val.numel()


@pytest.mark.parametrize("constraints, cast_once", [({"dp": 2}, True), ({"dp": 2, "fsdp": 3}, False)])
def test_the_program_reads_each_weight_it_reads_as_stored_cast_once_a_step(two_fake_ranks, constraints, cast_once
                                                                           ) -> None:
    """Under data parallelism every float8 linear reads its weight's e4m3 copy and scale as two placeholders,
    which ``StepCasts`` makes from the parameter as the linear's own cast would; under FSDP (gathered) none."""
    from autopar.passes.program import build_program
    from autopar.runtime.parallel_module import mesh_for_plan

    bundle = build("tiny-llama", None, 8, None, 0)
    plan = autopar.plan(bundle.model, bundle.example_inputs, "1x2xcpu", bundle.loss_fn,
                        example_targets=bundle.example_targets, constraints={**constraints, "fp8": "tensorwise"})
    captured = capture(bundle.model, bundle.example_inputs, bundle.example_targets, bundle.loss_fn)
    built = build_program(plan, captured, mesh_for_plan(plan))
    (stage,) = built.stages
    linears = [n for n in stage.program.graph_module.graph.nodes if n.target in (f8.float8_mm, f8.float8_addmm)]
    read = [n.kwargs.get("weight_cast") is not None for n in linears]
    assert len(linears) == len(float8_linears(captured)) and read == [cast_once] * len(linears)
    assert len(built.step_casts.casts) == (len(float8_weights(captured)) if cast_once else 0)
    if cast_once:
        (scale, copy), (param, _) = next(iter(built.step_casts.casts.items()))
        assert {scale, copy} <= set(stage.program.placeholders)
        value = torch.randn(captured.node(param).meta["val"].shape)
        made = built.step_casts.made_from({param: value}.__getitem__, {scale})
        by_hand = f8.cast_e4m3(value.t())
        assert torch.equal(made[scale], by_hand[0]) and torch.equal(made[copy].float(), by_hand[1].float())


def test_fp8_is_refused_for_a_model_it_cannot_take_and_in_a_bad_plan_file(tmp_path) -> None:
    """The command line's refusals (a device without FP8 tensor cores, a recipe it does not know) are in
    tests/test_bad_inputs.py; here the API's and a plan file's."""
    bundle = build_model("tiny-gpt", overrides={"hidden": 24, "heads": 2})
    with pytest.raises(BadInputError, match="this model has no linear layer float8 can run"):
        autopar.plan(bundle.model, bundle.example_inputs, "1x8xH100", bundle.loss_fn, {"fp8": "tensorwise"},
                     example_targets=bundle.example_targets)
    plan = _plan("tiny-llama --cluster 1x8xH100 --global-batch 8 --fix fp8=tensorwise,dp=8")
    plan["precision"]["fp8"] = "delayed"
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    with pytest.raises(PlanFormatError, match="precision.fp8 must be one of tensorwise, got 'delayed'"):
        Plan.load(tmp_path / "bad.json")


@contextmanager
def scaled_float8_gradients(factor: float = 1.25) -> Iterator[None]:
    """Every float8 linear's input gradient ``factor`` times too large: what a wrong scale would do."""
    backward = f8.Float8Matmul.backward

    def scaled(ctx, grad):
        grad_a, *others = backward(ctx, grad)
        return (None if grad_a is None else grad_a * factor), *others

    f8.Float8Matmul.backward = staticmethod(scaled)
    try:
        yield
    finally:
        f8.Float8Matmul.backward = staticmethod(backward)


RUNS = [({"dp": 2}, True, 3), ({"dp": 2, "fsdp": 3, "checkpointing": "selective"}, False, 3),
        ({"tp": 2}, True, 1), ({"pp": 2}, False, 2), ({"dp": 2, "microbatches": 2}, True, 2)]
"""(constraints, lowered, steps): DDP and tensor parallelism lowered, FSDP with selective recomputation and a
pipeline on DTensor, DDP lowered over two microbatches (its weights' casts made once a step, read by both), held
to ``testing.parity.FP8``. Tensor parallelism sums a row-split product in another
order, which moves the next step's weights by an ulp of fp32 and can round their float8 copies to the
neighbouring value: its run is one step, whose gradients and update are compared."""


def _run(constraints: dict, lowered: bool, steps: int, model: str = "tiny-llama", **extra) -> dict:
    return dict(name=model, overrides=None, global_batch=8, seq=32, steps=steps, plan=None,
                constraints={**constraints, "fp8": "tensorwise"}, lowered=lowered, **extra)


@pytest.fixture(scope="module")
def float8_runs():
    extra = [_run({"dp": 2}, True, 2, "tiny-gpt"), _run({"dp": 2}, True, 1, under=scaled_float8_gradients)]
    return train_parallel_many(2, [_run(*run) for run in RUNS] + extra)


@pytest.mark.dist
@pytest.mark.slow
def test_float8_plans_train_as_one_process_running_the_same_float8_linears(float8_runs) -> None:
    references = {steps: train_single("tiny-llama", None, 8, 32, steps, fp8="tensorwise") for steps in (1, 3)}
    references[2] = train_single("tiny-llama", None, 8, 32, 2, fp8="tensorwise", microbatches=2)
    plain = train_single("tiny-llama", None, 8, 32, 3)
    assert max((references[3].grads[k] - plain.grads[k]).abs().max() for k in plain.grads) > 1e-4  # float8 ran
    for result, (constraints, lowered, steps) in zip(float8_runs, RUNS):
        assert result.plan["precision"]["fp8"] == "tensorwise" and result.tolerances == FP8
        assert not result.lowered.get("fallbacks")
        result.assert_matches(references[steps], f"float8 under {constraints}")
    linears_with_bias = float8_runs[-2]  # GPT's: addmm
    linears_with_bias.assert_matches(train_single("tiny-gpt", None, 8, 32, 2, fp8="tensorwise"), "GPT under dp=2")
    scaled = float8_runs[-1]
    assert any("gradients after the first backward" in m for m in scaled.mismatches(references[1], FP8))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.extended
def test_a_bf16_float8_plan_trains_as_one_process_in_bf16_with_the_same_float8_linears() -> None:
    [result] = train_parallel_many(2, [_run({"dp": 2, "dtype": "bf16"}, True, 2)])
    reference = train_single("tiny-llama", None, 8, 32, 2, dtype="bf16", fp8="tensorwise")
    assert result.plan["precision"] == {"compute": "bf16", "master": "fp32", "reduce": "fp32", "fp8": "tensorwise"}
    assert result.tolerances == FP8
    result.assert_matches(reference)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.extended
def test_a_compiled_float8_plan_trains_within_float8s_rounding_of_one_process() -> None:
    """Inductor's fused kernels round some fp32 values otherwise, and a value an fp32 unit apart may cast to the
    neighbouring e4m3 value: a compiled float8 plan matches within ``FP8``, not bit for bit."""
    [result] = train_parallel_many(2, [_run({"dp": 2}, True, 2, compile=True)])
    assert result.lowered["programs"] == 1 and result.lowered["compiled"] == 1
    result.assert_matches(train_single("tiny-llama", None, 8, 32, 2, fp8="tensorwise"))


def _counted_float8_steps(rank: int, world: int) -> list[dict]:
    return [counted_step("tiny-llama", None, 8, {**constraints, "fp8": "tensorwise"}) for constraints in COUNTED]


COUNTED = [{"dp": 2}, {"tp": 2}]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.extended
def test_a_float8_step_runs_the_amax_all_reduces_the_plan_predicts() -> None:
    """On DTensor, whose collectives are the plan's one by one: the forward runs exactly the predicted
    collectives, the float8 amaxes among them, and the whole step the predicted all_reduces but for the
    data-parallel lazy reductions ``tests/test_collective_parity.py`` lists (none for tiny Llama)."""
    for result, constraints in zip(run_on_ranks(_counted_float8_steps, 2)[0], COUNTED):
        amaxes = [t for op in result["plan"]["ops"].values() for t in op.get("collectives", [])
                  if t["why"].startswith("float8 amax")]
        assert amaxes, constraints
        assert result["forward"] == as_run_on_gloo(predicted_collectives(result["plan"], ["forward"])), constraints
        predicted = predicted_collectives(result["plan"], ["forward", "backward", "grad_sync"])
        assert result["step"].get("all_reduce") == predicted.get("all_reduce"), (constraints, result["step"], predicted)


CAST = [({"tp": 2, "microbatches": 2}, True), ({"dp": 2, "fsdp": 3, "microbatches": 2}, False)]
"""(constraints, whether the weights are read as stored): tensor parallelism reads each weight's shard as it is
stored, FSDP gathers each one."""


def _weight_casts(rank: int, world: int) -> list[tuple[int, list[bool], dict]]:
    """Per ``CAST`` plan, one step of tiny Llama on DTensor: how many times the step made its weights' casts
    (``StepCasts.made_from``), and per float8 matmul run whether it read its weight's cast made for the step."""
    from autopar.models import build_model
    from autopar.testing.parity import batches

    runs = []
    for constraints, _ in CAST:
        bundle = build_model("tiny-llama", global_batch=8, device="cpu")
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, lowered=False,
                                     constraints={**constraints, "fp8": "tensorwise", "runtime": "dtensor"})
        made, read = [0], []
        make, forward = f8.StepCasts.made_from, f8.Float8Matmul.forward

        def counted_make(self, *args):
            made[0] += 1
            return make(self, *args)

        def recorded_forward(ctx, a, b, weight_first, weight_cast=None):
            read.append(weight_cast is not None)
            return forward(ctx, a, b, weight_first, weight_cast)

        f8.StepCasts.made_from, f8.Float8Matmul.forward = counted_make, staticmethod(recorded_forward)
        try:
            pm.step(*batches(bundle, 1, seed=0)[0])
        finally:
            f8.StepCasts.made_from, f8.Float8Matmul.forward = make, staticmethod(forward)
        runs.append((made[0], read, pm.plan.to_dict()))
    return runs


@pytest.mark.dist
@pytest.mark.slow
def test_a_step_casts_each_weight_read_as_stored_once_and_a_gathered_one_in_every_microbatch() -> None:
    """Two microbatches: under tensor parallelism every float8 matmul of both reads its weight's e4m3 copy made
    once for the step, and the plan counts those weights' amax all_reduces once; under FSDP each matmul casts the
    weight it gathered, and the plan counts none once."""
    linears = len(float8_linears(_captured("tiny-llama")))
    for (made, read, plan), (constraints, as_stored) in zip(run_on_ranks(_weight_casts, 2)[0], CAST):
        assert made == 1 and read == [as_stored] * 2 * linears, constraints
        once = [t for op in plan["ops"].values() for t in op.get("collectives", []) if t.get("once_a_step")]
        assert bool(once) == as_stored and all(t["why"].endswith("once a step") for t in once), constraints
