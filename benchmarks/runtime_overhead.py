"""How much does autopar's runtime cost over the same parallelism written by hand with native PyTorch?

On gloo ranks of this machine, for the built-in GPT and Llama (small configs) under data parallelism
(DDP), FSDP, tensor parallelism, tensor + sequence parallelism and a two-stage pipeline (times data
parallelism on four ranks), one training step (forward, loss, backward, gradient synchronization; no
optimizer update) of three programs:

* ``dtensor``: autopar's program on DTensor values (``autoparallelize(..., lowered=False)``);
* ``lowered``: autopar's lowered program, forward and backward graphs of local tensor ops with
  explicit collectives (``lowered=True``, ``passes/lower.py``);
* ``compiled`` (with ``--compiled``): the lowered program compiled by inductor (``compile=True``);
* ``native``: the same parallelism written by hand: ``DistributedDataParallel``, ``fully_shard`` per
  block and the root, ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` (and
  ``SequenceParallel`` on the norms), attention modules running their local heads; for the pipeline,
  ``torch.distributed.pipelining``'s ``PipelineStage`` over each half of the blocks (the embeddings with
  the first, the final norm and head with the last) under ``Schedule1F1B``, each stage in
  ``DistributedDataParallel`` over its data-parallel replicas (which pipelining syncs once, in the last
  microbatch's backward).

autopar's plans are pinned to the same degrees (``fsdp`` 0 or 3, ``sp`` 0 or 1, no checkpointing, one
microbatch; the pipeline: ``pp`` 2, ``dp`` the rest, 1F1B over ``MICROBATCHES`` microbatches, each rank's
chunk lowered as a whole program is). The three run alternately, step by step in one process group,
``--steps`` times after ``WARMUP_STEPS`` (the lowered program traces at its first step), so a load change
on the machine hits all three alike; each step's time is the slowest rank's. Prints a Markdown table (median and the 10th-90th
percentile spread, in ms, and each autopar program's median over native's, then in parentheses the median of
its step-by-step ratios to native's step of the same round, which a slow drift of the machine's load moves
less; last, the same paired ratio of the CPU seconds each rank spent on the step, averaged over the ranks:
where ranks share cores their wall time also holds each other's turns on them) and writes every sample as
JSON (``samples_s``, ``cpu_samples_s``); ``--programs`` times a subset (all of them alternate with one
another just the same)::

    python benchmarks/runtime_overhead.py --world 2 --steps 30 --out benchmarks/results/runtime_overhead.json
    python benchmarks/runtime_overhead.py --world 2 4 --models gpt --parallelisms dp fsdp --programs lowered native
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.files import write_atomically
from autopar.testing.launch import run_on_ranks

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt": ("tiny-gpt", {"layers": 4, "hidden": 128, "heads": 4, "vocab": 1024, "seq": 64}),
    "llama": ("tiny-llama", {"layers": 4, "hidden": 128, "heads": 8, "kv_heads": 4, "ffn_hidden": 256,
                             "vocab": 1024, "seq": 64}),
}
PIPELINE_STAGES, MICROBATCHES = 2, 4
PARALLELISMS: dict[str, dict[str, Any]] = {
    "dp": {"fsdp": 0}, "fsdp": {"fsdp": 3}, "tp": {"sp": 0}, "tp+sp": {"sp": 1},
    "pp": {"fsdp": 0, "microbatches": MICROBATCHES, "schedule": "1f1b"},
}
"""Each parallelism's constraints besides its degrees (``degrees``)."""
BATCH = 8
WARMUP_STEPS = 3
PROGRAMS = ("dtensor", "lowered", "compiled", "native")

Step = Callable[[], Any]


# ---- autopar --------------------------------------------------------------------------------------
def autopar_step(bundle: Any, parallelism: str, world: int, lowered: bool, compile: bool = False) -> Step:
    import autopar

    constraints = {**degrees(parallelism, world), "checkpointing": "none", "microbatches": 1,
                   **PARALLELISMS[parallelism]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.autoparallelize(bundle.model, bundle.example_inputs, loss_fn=bundle.loss_fn,
                                     example_targets=bundle.example_targets, constraints=constraints,
                                     lowered=lowered, compile=compile)
    batch = (*bundle.example_inputs, bundle.example_targets)
    params = list(pm.parameters())
    return lambda: _zeroed(params) or pm.step(*batch)


def degrees(parallelism: str, world: int) -> dict[str, int]:
    """The degrees a parallelism pins on ``world`` ranks: ``tp`` or ``dp`` the world; a pipeline's stages, and
    ``dp`` the rest."""
    if parallelism == "pp":
        return {"pp": PIPELINE_STAGES, "dp": world // PIPELINE_STAGES}
    return {("tp" if parallelism.startswith("tp") else "dp"): world}


# ---- native PyTorch -------------------------------------------------------------------------------
def native_step(bundle: Any, parallelism: str, world: int) -> Step:
    if parallelism == "pp":
        return _native_pipeline_step(bundle, world)
    model, (x,), y = bundle.model, bundle.example_inputs, bundle.example_targets
    if parallelism in ("dp", "fsdp"):  # each rank its slice of the batch
        rank = dist.get_rank()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    module = _natively_parallel(model, parallelism, world)
    params = list(module.parameters())

    def step() -> Any:
        _zeroed(params)
        loss = bundle.loss_fn(module(x), y)
        loss.backward()
        return loss
    return step


def _natively_parallel(model: nn.Module, parallelism: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if parallelism == "dp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return _tensor_parallel(model, mesh, sequence=parallelism == "tp+sp")


def _tensor_parallel(model: nn.Module, mesh: Any, sequence: bool) -> nn.Module:
    """Megatron-LM's layout: q, k, v and the MLP's first linear(s) column-split, o_proj and the last
    linear row-split, each attention module on its local heads; embeddings and the head whole. With
    ``sequence``, torchtitan's plan: the residual stream and the norms split on the sequence, the normed
    input gathered once per attention and per MLP, the row-split outputs reduce-scattered back."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh.size()
    rows_out = {"output_layouts": Shard(1)} if sequence else {}
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.heads //= tp
        if hasattr(attn, "kv_heads"):
            attn.kv_heads //= tp
        columns = ["attn.q_proj", "attn.k_proj", "attn.v_proj"] + (["mlp.w1", "mlp.w3"] if hasattr(mlp, "w1")
                                                                   else ["mlp.fc_in"])
        rows = ["attn.o_proj", "mlp.w2" if hasattr(mlp, "w2") else "mlp.fc_out"]
        styles: dict[str, Any] = {**{c: ColwiseParallel() for c in columns},
                                  **{r: RowwiseParallel(**rows_out) for r in rows}}
        if sequence:
            extra = 2 if hasattr(block, "attn_norm") else 0  # Llama's attention also takes cos and sin
            gathered = lambda n: PrepareModuleInput(input_layouts=(Shard(1), *[None] * n),  # noqa: E731
                                                    desired_input_layouts=(Replicate(), *[None] * n),
                                                    use_local_output=True)
            norms = [n for n, _ in block.named_children() if "norm" in n or n.startswith("ln")]
            styles.update({n: SequenceParallel() for n in norms})
            styles.update({"attn": gathered(extra), "mlp": gathered(0)})
        parallelize_module(block, mesh, styles)
    if sequence:
        final = "ln_f" if hasattr(model, "ln_f") else "norm_f"
        parallelize_module(model, mesh, {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            final: SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            **({"pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))}
               if hasattr(model, "pos_emb") else {}),
        })
    return model


class _PipelineStageModule(nn.Module):
    """Stage ``index`` of ``stages`` of the built-in GPT or Llama: its share of the blocks, with the embeddings
    on the first stage and the final norm and head on the last (a plain split, as torchtitan's manual one)."""

    def __init__(self, model: nn.Module, index: int, stages: int) -> None:
        super().__init__()
        per = len(model.blocks) // stages
        self.first, self.last = index == 0, index == stages - 1
        self.blocks = nn.ModuleList(model.blocks[index * per:(index + 1) * per])
        self.llama = hasattr(model, "rope_cos")
        if self.llama:  # the rotary tables every Llama block reads
            self.register_buffer("cos", model.rope_cos, persistent=False)
            self.register_buffer("sin", model.rope_sin, persistent=False)
        if self.first:
            self.tok_emb = model.tok_emb
            if not self.llama:
                self.pos_emb = model.pos_emb
                self.register_buffer("pos_ids", model.pos_ids, persistent=False)
        if self.last:
            self.norm, self.lm_head = (model.norm_f if self.llama else model.ln_f), model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            seq = x.shape[1]
            x = self.tok_emb(x) if self.llama else self.tok_emb(x) + self.pos_emb(self.pos_ids[:seq])
        for block in self.blocks:
            x = block(x, self.cos[:x.shape[1]], self.sin[:x.shape[1]]) if self.llama else block(x)
        return self.lm_head(self.norm(x)) if self.last else x


def _native_pipeline_step(bundle: Any, world: int) -> Step:
    """``PIPELINE_STAGES`` stages under ``Schedule1F1B``, each stage's module in DDP over its replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    dp = world // PIPELINE_STAGES
    mesh = init_device_mesh("cpu", (PIPELINE_STAGES, dp), mesh_dim_names=("pp", "dp"))
    index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module: nn.Module = _PipelineStageModule(bundle.model, index, PIPELINE_STAGES)
    if dp > 1:
        module = DistributedDataParallel(module, process_group=mesh.get_group("dp"))
    stage = PipelineStage(module, index, PIPELINE_STAGES, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=bundle.loss_fn)
    (x,), y = bundle.example_inputs, bundle.example_targets
    x, y = x.chunk(dp)[replica], y.chunk(dp)[replica]
    params = list(module.parameters())

    def step() -> Any:
        _zeroed(params)
        if index == 0:
            return schedule.step(x)
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses)
        return losses
    return step


def _zeroed(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


# ---- measuring ------------------------------------------------------------------------------------
def measured_rank(rank: int, world: int, steps: int, models: list[str], parallelisms: list[str],
                  programs: list[str]) -> list[dict[str, Any]]:
    from autopar.models import build_model

    rows = []
    for model_name in models:
        preset, overrides = MODELS[model_name]
        for parallelism in parallelisms:
            def bundle() -> Any:
                return build_model(preset, overrides=overrides, global_batch=BATCH, device="cpu", seed=0)
            built = _programs(bundle, parallelism, world, programs)
            samples, cpu = _alternating(built, steps)
            rows.append({"model": model_name, "config": overrides, "parallelism": parallelism, "world": world,
                         "batch": BATCH, "samples_s": samples, "cpu_samples_s": cpu,
                         "errors": {k: v for k, v in built.items() if isinstance(v, str)}})
    return rows


def _programs(bundle: Callable[[], Any], parallelism: str, world: int, programs: list[str]) -> dict[str, Step | str]:
    """Each of ``programs``' step, or why it could not be built or run (the row then says so)."""
    makers = {"dtensor": lambda: autopar_step(bundle(), parallelism, world, lowered=False),
              "lowered": lambda: autopar_step(bundle(), parallelism, world, lowered=True),
              "compiled": lambda: autopar_step(bundle(), parallelism, world, lowered=True, compile=True),
              "native": lambda: native_step(bundle(), parallelism, world)}
    built: dict[str, Step | str] = {}
    for name in programs:
        make = makers[name]
        try:
            built[name] = make()
            built[name]()  # a step that fails fails here, on every rank alike
        except Exception as exc:  # noqa: BLE001: one program failing leaves the others measured, said in the row
            built[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return built


def _alternating(programs: dict[str, Step | str], steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per program, the slowest rank's seconds of each timed step, and the CPU seconds (``process_time``: the
    rank's threads, gloo's included) its ranks spent on the step, averaged over them; the programs take
    turns step by step. Where ranks share cores (4 ranks on this machine's 2), a step's wall time also holds
    the other ranks' turns on the cores; its CPU time is the rank's own work, the steadier of the two."""
    runnable = {name: step for name, step in programs.items() if not isinstance(step, str)}
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    cpu: dict[str, list[float]] = {name: [] for name in runnable}
    for i in range(WARMUP_STEPS + steps):
        for name, step in runnable.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if i >= WARMUP_STEPS:
                samples[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    return ({name: _over_ranks(s, max) for name, s in samples.items()},
            {name: _over_ranks(s, statistics.mean) for name, s in cpu.items()})


def _over_ranks(samples: list[float], combine: Callable[[Any], float]) -> list[float]:
    """Each step's samples of every rank combined into one (``max``: the slowest rank's)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    return [combine(step) for step in zip(*gathered)]


# ---- reporting ------------------------------------------------------------------------------------
def summary(samples: list[float]) -> dict[str, float]:
    """Median and 10th/90th percentiles, in ms."""
    ms = sorted(s * 1e3 for s in samples)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"median_ms": statistics.median(ms), "p10_ms": pick(0.1), "p90_ms": pick(0.9)}


def table(rows: list[dict[str, Any]]) -> str:
    programs = [p for p in PROGRAMS if any(p in row["samples_s"] or p in row["errors"] for row in rows)]
    ratios = [p for p in programs if p != "native"]
    lines = ["| model | parallelism | world | " + " | ".join(f"{p} ms" for p in programs) + " | "
             + " | ".join(f"{p} / native" for p in ratios) + " | "
             + " | ".join(f"{p} / native, CPU" for p in ratios) + " |",
             "|---|---|---|" + "---|" * (len(programs) + 2 * len(ratios))]
    for row in rows:
        stats = {name: summary(s) for name, s in row["samples_s"].items() if s}
        cells = [_cell(stats, row["errors"], p) for p in programs]
        cells += [f"{stats[p]['median_ms'] / stats['native']['median_ms']:.2f} "
                  f"({paired_ratio(row['samples_s'][p], row['samples_s']['native']):.2f})"
                  if p in stats and "native" in stats else "-" for p in ratios]
        cpu = row.get("cpu_samples_s", {})
        cells += [f"{paired_ratio(cpu[p], cpu['native']):.2f}" if cpu.get(p) and cpu.get("native") else "-"
                  for p in ratios]
        lines.append(f"| {row['model']} | {row['parallelism']} | {row['world']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_ratio(samples: list[float], native: list[float]) -> float:
    """The median of the ratios of each step of a program to the native step of the same round."""
    return statistics.median(a / b for a, b in zip(samples, native))


def _cell(stats: dict[str, dict[str, float]], errors: dict[str, str], program: str) -> str:
    """Median (10th-90th percentile) in ms, or why the program did not run."""
    if program in stats:
        s = stats[program]
        return f"{s['median_ms']:.1f} ({s['p10_ms']:.1f}-{s['p90_ms']:.1f})"
    return f"failed: {errors.get(program, '?')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--parallelisms", nargs="+", default=list(PARALLELISMS), choices=list(PARALLELISMS))
    parser.add_argument("--compiled", action="store_true", help="also the lowered program compiled by inductor")
    parser.add_argument("--programs", nargs="+", default=[p for p in PROGRAMS if p != "compiled"], choices=PROGRAMS,
                        help="the programs to time (default: all but compiled)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/runtime_overhead.json"))
    args = parser.parse_args()
    rows = []
    for world in args.world:
        programs = [p for p in PROGRAMS if p in args.programs or (p == "compiled" and args.compiled)]
        rows += run_on_ranks(measured_rank, world, args.steps, args.models, args.parallelisms, programs,
                             timeout_s=3600)[0]
    print(table(rows))
    write_atomically(args.out, json.dumps({"torch": torch.__version__, "warmup_steps": WARMUP_STEPS,
                                           "steps": args.steps, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
