"""Ring attention (issue 16): context parallelism whose keys and values travel around the cp ranks
(``passes/ring_attention.py``), priced beside the all-gather of keys and values and picked per plan.

* The op: on 4 gloo ranks, ring attention's output and its gradients for queries, keys and values equal
  fused attention's on the whole sequence (causal under the load-balanced layout with grouped-query
  attention, causal in contiguous chunks, not causal, and values of another head dim than the keys).
* The planner prices both ways per op and the ILP picks (``plan.cp_attention`` says which): over a slow
  cp link a long sequence hides the ring's exchanges behind its blocks' compute and rings, a short one
  cannot and gathers; ``--fix cp_attention=`` pins either; ``show`` and ``explain`` say which and why.
* Parity on gloo (SGD, 3 steps, tiny-llama at 256 tokens): cp=2 ring (load-balanced and contiguous),
  cp=4, cp=2 x dp=2, cp=2 x tp=2 and cp=2 x pp=2 (1F1B) ring equal single-process training; the
  point-to-point sends of a cp=2 ring step are the plan's, forward and backward; the lowered runtime
  lowers the all-gather's program and runs the ring's on DTensor.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.cli import main
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.inspect.collectives import predicted_collectives
from autopar.models import build_model
from autopar.passes.ring_attention import ring_attention
from autopar.passes.sequence_layout import rank_ranges
from autopar.testing.counters import counted_step
from autopar.testing.launch import run_on_ranks
from autopar.testing.parity import AutoparResult, train_parallel_many, train_single

BATCH = 8
STEPS = 3
LONG = {"seq": 256}
RING = {"cp_attention": "ring"}


def _plan(name: str, constraints: dict, cluster: str, overrides: dict | None = None, batch: int = BATCH,
          device: str = "cpu") -> autopar.Plan:
    bundle = build_model(name, overrides=overrides, global_batch=batch, device=device)
    return autopar.plan(bundle.model, bundle.example_inputs, cluster, bundle.loss_fn, constraints,
                        example_targets=bundle.example_targets)


def _attention(plan: autopar.Plan) -> list[dict]:
    return [op for op in plan.ops.values() if "scaled_dot_product_attention" in op["op"]]


# ---- the op ----------------------------------------------------------------------------------------
def _ring_against_fused_attention(rank: int, world: int) -> list[float]:
    """Largest differences of output and gradients from SDPA's, per case, on this rank's rows."""
    errors = []
    for balanced, grouped, causal, value_dim in ((True, True, True, 8), (False, False, True, 8),
                                                 (True, False, False, 8), (True, False, True, 6)):
        torch.manual_seed(0)
        b, heads, kv_heads, s, d = 2, 4, 2 if grouped else 4, 16, 8
        q, k, v = (torch.randn(b, h, s, e, requires_grad=True)
                   for h, e in ((heads, d), (kv_heads, d), (kv_heads, value_dim)))
        grad = torch.randn(b, heads, s, value_dim)
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped).backward(grad)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped).detach()
        ranges = [rank_ranges(s, world, r) if balanced else ((r * s // world, (r + 1) * s // world),)
                  for r in range(world)]
        rows = torch.cat([torch.arange(a, e) for a, e in ranges[rank]])
        mine = [t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(dist.group.WORLD, ranges, *mine, is_causal=causal, enable_gqa=grouped)
        out.backward(grad[:, :, rows])
        errors.append(max(float((got - want[:, :, rows]).abs().max()) for got, want in
                          ((out.detach(), expected), *((t.grad, whole.grad) for t, whole in zip(mine, (q, k, v))))))
    return errors


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_ring_attention_equals_fused_attention_on_4_ranks() -> None:
    for errors in run_on_ranks(_ring_against_fused_attention, 4):
        assert max(errors) < 1e-5, errors


# ---- the planner -----------------------------------------------------------------------------------
def _llama_8b(seq: int, constraints: dict) -> autopar.Plan:
    """Two layers of Llama 3 8B at ``seq`` tokens, 2 sequences, under cp=2 across two nodes (InfiniBand)."""
    return _plan("llama3-8b", {"cp": 2, **constraints}, "2x1xH100", {"layers": 2, "seq": seq}, batch=2, device="meta")


@pytest.mark.parametrize("seq, chosen", [(32768, "ring"), (2048, "allgather")])
def test_the_planner_rings_a_long_sequence_and_gathers_a_short_one_over_a_slow_link(seq: int, chosen: str) -> None:
    """By hand, per attention op on one H100 per node: a rank's key-value block is 2 sequences x 8
    kv heads x seq/2 x 128 x 2 bytes x (K and V), sent over InfiniBand in ``send``; one block's forward
    attention takes ``block`` (a half of the rank's: quadratic in seq). The ring exposes
    ``max(0, send - block) + max(0, 2 send - 2.5 block) + send`` (forward one exchange, backward one
    step of two behind the block's backward, which recomputes the scores, and the last dK-dV block
    home); the all-gather ``3 send`` or so (K and V gathered, gathered again in backward rather than kept,
    their gradients reduce-scattered: each moves the other rank's half). At 2k tokens the block's attention
    is far shorter than its send, so the ring exposes about ``4 send`` and the gather wins; at 32k the block
    takes longer than its send and the ring exposes the last send alone. Both keep their own block."""
    free, ring, gather = (_llama_8b(seq, c) for c in ({}, RING, {"cp_attention": "allgather"}))
    assert free.cp_attention == chosen and ring.cp_attention == "ring" and gather.cp_attention == "allgather"
    times = {"ring": ring.predicted["step_time_s"], "allgather": gather.predicted["step_time_s"]}
    assert free.predicted["step_time_s"] == pytest.approx(min(times.values()), rel=1e-9)
    assert times[chosen] < times["ring" if chosen == "allgather" else "allgather"]
    (op, *_), (gathered, *_) = _attention(ring), _attention(gather)
    forward_s = op["cost"]["compute_s"] / 3.5  # forward + backward, backward 2.5x (scores recomputed)
    send = op["collectives"][0]["seconds"]
    exposed = max(0.0, send - forward_s / 2) + max(0.0, 2 * send - 2.5 * forward_s / 2) + send
    assert op["cost"]["comm_s"]["p2p"] == pytest.approx(exposed, rel=1e-9)
    assert gathered["cost"]["memory_bytes"] == op["cost"]["memory_bytes"]
    again = [c for c in gathered["collectives"] if c["phase"] == "backward" and c["kind"] == "all_gather"]
    assert len(again) == 2 and all(c["why"].endswith("again in backward") for c in again)  # K and V


def test_pinned_ring_splits_keys_and_values_and_predicts_its_sends() -> None:
    plan = _plan("tiny-llama", {"cp": 2, **RING}, "1x2xcpu", LONG).to_dict()
    attention = [op for op in plan["ops"].values() if "scaled_dot_product_attention" in op["op"]]
    assert attention and all(op["inputs"] == [["S(2)"]] * 3 and op["outputs"] == [["S(2)"]] and op["local"]
                             for op in attention)
    assert plan["cp_attention"] == "ring" and plan["cp_layout"] == "load_balanced"
    layers = plan["model"]["layers"]  # per layer: 1 exchange forward, 1 + 2 backward (cp - 1 and cp)
    assert predicted_collectives(plan, ["forward"])["send_recv"] == layers
    assert predicted_collectives(plan)["send_recv"] == 4 * layers
    assert "reduce_scatter" not in predicted_collectives(plan)


def test_a_plan_without_cp_attention_reads_as_allgather() -> None:
    plan = _plan("tiny-llama", {"cp": 2, "cp_attention": "allgather"}, "1x2xcpu", LONG).to_dict()
    del plan["cp_attention"]
    assert autopar.Plan.from_dict(plan).cp_attention == "allgather"
    with pytest.raises(PlanFormatError, match="cp_attention must be one of allgather, ring, got 'tree'"):
        autopar.Plan.from_dict({**plan, "cp_attention": "tree"})


def test_cp_attention_needs_cp_above_one() -> None:
    with pytest.raises(BadInputError, match="cp_attention=ring chooses how attention runs .* needs cp > 1, got cp=1"):
        _plan("tiny-llama", {"cp": 1, **RING}, "1x2xcpu", LONG)


def _cli_plan(tmp_path, fix: str) -> tuple[str, dict]:
    out = tmp_path / f"{fix}.json"
    assert main(["plan", "tiny-llama", "--cluster", "1x2xcpu", "--set", "seq=256", "--global-batch", "8",
                 "--fix", fix, "--json", "-o", str(out)]) == 0
    return str(out), json.loads(out.read_text())


class _MaskedAttention(torch.nn.Module):
    """One attention layer with an attention mask tensor: the ring does not take one."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_ring_is_refused_for_attention_with_a_mask_tensor() -> None:
    x = torch.randn(2, 8, 16)
    with pytest.raises(BadInputError, match="cp_attention=ring: fused attention .* because of its attention mask"):
        autopar.plan(_MaskedAttention(), (x,), "1x2xcpu", lambda out: out.mean(), {"cp": 2, **RING})
    free = autopar.plan(_MaskedAttention(), (x,), "1x2xcpu", lambda out: out.mean(), {"cp": 2})
    assert free.cp_attention == "allgather"


def test_fix_cp_attention_on_the_command_line_show_and_explain(tmp_path, capsys) -> None:
    """Free on two CPU ranks, the ring wins (one exchange of K and V stacked, behind compute, against
    gathering each); pinned, either runs; ``explain`` lists both ways with their prices."""
    (free, free_plan), (_, pinned) = _cli_plan(tmp_path, "cp=2"), _cli_plan(tmp_path, "cp=2,cp_attention=allgather")
    assert free_plan["cp_attention"] == "ring" and pinned["cp_attention"] == "allgather"
    assert free_plan["predicted"]["step_time_s"] < pinned["predicted"]["step_time_s"]
    attention = next(name for name, op in free_plan["ops"].items() if "scaled_dot_product_attention" in op["op"])
    capsys.readouterr()
    assert main(["show", free]) == 0
    assert "cp=2, load_balanced layout, ring attention" in capsys.readouterr().out
    assert main(["explain", free, attention]) == 0
    explained = capsys.readouterr().out
    assert "* (S(2)), (S(2)), (S(2)) -> (S(2))" in explained and "  (S(2)), (R), (R) -> (S(2))" in explained
    assert "send_recv over cp (ring attention" in explained


def test_reprice_carries_cp_attention(tmp_path) -> None:
    """A ring plan and a gathering one, re-priced with the cp dim across two nodes: each keeps its way."""
    problem = tmp_path / "problem.json"
    for way in ("ring", "allgather"):
        out, plan = tmp_path / f"{way}.json", tmp_path / f"{way}-2x1.json"
        assert main(["plan", "tiny-llama", "--cluster", "1x2xcpu", "--set", "seq=256", "--global-batch", "8",
                     "--fix", f"cp=2,cp_attention={way}", "--save-problem", str(problem), "-o", str(out)]) == 0
        assert main(["reprice", str(out), "--problem", str(problem), "--cluster", "2x1xcpu", "-o", str(plan)]) == 0
        repriced = json.loads(plan.read_text())
        assert repriced["cp_attention"] == way and repriced["cluster"]["spec"] == "2x1xcpu"


# ---- parity and sends on gloo -----------------------------------------------------------------------
def _run(overrides: dict | None, constraints: dict, plan: dict | None = None) -> dict:
    return dict(name="tiny-llama", overrides=overrides, global_batch=BATCH, seq=None, steps=STEPS, plan=plan,
                constraints=constraints)


@pytest.mark.dist
@pytest.mark.slow
def test_ring_on_2_ranks_matches_single_process() -> None:
    """Load-balanced, and in contiguous chunks (a plan's layout changed by hand)."""
    contiguous = {**_plan("tiny-llama", {"cp": 2, **RING}, "1x2xcpu", LONG).to_dict(), "cp_layout": "contiguous"}
    results = train_parallel_many(2, [_run(LONG, {"cp": 2, **RING}), _run(LONG, {}, contiguous)])
    reference = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    assert [(r.plan["cp_attention"], r.plan["cp_layout"]) for r in results] == [
        ("ring", "load_balanced"), ("ring", "contiguous")]
    for result in results:
        result.assert_matches(reference)


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_ring_on_4_ranks_matches_single_process() -> None:
    results = train_parallel_many(4, [_run(LONG, {"cp": 2, "dp": 2, **RING}), _run(LONG, {"cp": 4, **RING}),
                                      _run(LONG, {"cp": 2, "tp": 2, **RING}), _run(LONG, {"cp": 2, "pp": 2, **RING})])
    reference = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    assert [r.plan["mesh"]["dim_names"] for r in results] == [["dp", "cp"], ["cp"], ["cp", "tp"], ["cp"]]
    assert results[3].plan["degrees"]["pp"] == 2
    for result in results:
        assert result.plan["cp_attention"] == "ring"
        result.assert_matches(reference)


def _counted_ring_step(rank: int, world: int) -> dict:
    return counted_step("tiny-llama", LONG, BATCH, {"cp": 2, **RING})


@pytest.mark.dist
@pytest.mark.slow
def test_ring_runs_the_predicted_sends() -> None:
    """Each rank sends one key-value block per layer forward, and in backward one more and two dK-dV
    blocks (the second home to its owner): the plan's ``send_recv`` count; the rest as predicted."""
    counted = run_on_ranks(_counted_ring_step, 2)
    plan = counted[0]["plan"]
    forward, step = predicted_collectives(plan, ["forward"]), predicted_collectives(plan)
    assert step["send_recv"] == 4 * plan["model"]["layers"]
    for c in counted:
        assert c["forward"] == forward, (c["forward"], forward)
        assert c["step"] == step, (c["step"], step)


def _lowered(rank: int, world: int) -> list[dict]:
    """tiny-llama under cp=2, each way, on the lowered runtime: trained, and why it was not lowered."""
    from autopar.testing.parity import build, train_module

    found = []
    for way in ("allgather", "ring"):
        bundle = build("tiny-llama", LONG, BATCH, None, seed=0)
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, lowered=True,
                                     constraints={"cp": 2, "cp_attention": way})
        found.append({**train_module(pm, bundle, STEPS, 0, rank), "fallback": pm.program.fallback})
    return found


@pytest.mark.extended
@pytest.mark.dist
@pytest.mark.slow
def test_lowered_runtime_lowers_the_gather_and_runs_the_ring_on_dtensor() -> None:
    """The all-gather's load-balanced program traces (its reorder indices are made in the trace); the
    ring's exchanges do not, so that program runs on DTensor, saying why. Both match one process."""
    per_rank = run_on_ranks(_lowered, 2, timeout_s=900)
    reference = train_single("tiny-llama", LONG, BATCH, None, STEPS)
    gathered, ringed = ([r[i] for r in per_rank] for i in range(2))
    assert gathered[0]["fallback"] is None
    assert "ring attention does not trace" in ringed[0]["fallback"]
    for runs in (gathered, ringed):
        AutoparResult.from_ranks(runs).assert_matches(reference)

