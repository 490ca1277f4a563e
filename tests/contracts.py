"""The plan-JSON contract of docs/architecture.md "Plan JSON", and the explanations' contract, stated once
for the tests that check them."""

PLAN_KEYS = {"schema", "model", "cluster", "mesh", "degrees", "pipeline", "checkpointing", "placements", "ops",
             "predicted", "solver", "precision", "cp_layout", "cp_attention"}
SECTION_KEYS = {
    "model": {"name", "params", "layers", "flops_per_step"},
    "cluster": {"spec", "devices"},
    "mesh": {"shape", "dim_names"},
    "degrees": {"dp", "fsdp", "tp", "sp", "cp", "ep", "pp"},
    "pipeline": {"stages", "schedule", "microbatches", "microbatch_size"},
    "precision": {"compute", "master", "reduce"},
    "predicted": {"step_time_s", "tokens_per_s", "mfu", "compute_s", "comm_s", "exposed_comm_s", "bubble_s",
                  "peak_memory_bytes", "memory_bytes"},
    "solver": {"status", "objective", "bound", "gap", "wall_s", "variables", "constraints"},
}
COMM_KEYS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations"}


def assert_alternatives_priced_exactly(problem, key: str, choice: dict) -> None:
    """The explanations' contract on a two-option decision ``key`` of ``problem``: for either option
    taken (the others as in ``choice``), the alternative's ``delta_s`` is exactly the difference of the
    two step times ``solver.evaluate`` gives."""
    import pytest

    from autopar.planning.explanations import explanations
    from autopar.planning.solver import evaluate

    for chosen in (0, 1):
        taken = {**choice, key: chosen}
        rows = explanations(problem, taken, {})["decisions"][key]["alternatives"]
        other = next(row for row in rows if not row["chosen"])
        change = evaluate(problem, {**taken, key: 1 - chosen})[0] - evaluate(problem, taken)[0]
        assert other["delta_s"] == pytest.approx(change, abs=1e-15)
