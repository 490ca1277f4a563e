"""The plan-JSON contract of docs/architecture.md "Plan JSON", stated once for the tests that check it."""

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
