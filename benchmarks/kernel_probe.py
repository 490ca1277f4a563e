"""Does the cost model price single kernels as the device runs them? Op by op, predicted against measured.

Run on a CUDA machine (one GPU)::

    python benchmarks/kernel_probe.py --out benchmarks/results/kernel_probe.json

Issue 20's compute terms, checked one kernel family at a time instead of through a whole step, where
errors of opposite sign can cancel: GEMMs of the shapes Llama 3 and GPT-2 layers run (whole and
tensor-parallel slices, aligned and not), fused causal attention (``F.scaled_dot_product_attention``
as the built-in models call it, grouped-query too), the bandwidth-bound layers (the built-in RMSNorm,
``nn.LayerNorm``, SwiGLU's gate, rotary embedding) and cross-entropy over 32k- and 128k-token
vocabularies.

Each probe is one building block with its inputs, run as a layer inside a model runs it: the inputs
need gradients, so its backward computes every gradient the block has.

* **predicted**: ``autopar.plan`` of the block on one device of the catalog's preset for this GPU
  (``1x1x<preset>``: the datasheet figures and efficiencies a user's plan is priced with, nothing
  measured here), in the run's dtype. The plan's ``ops`` price each captured op's forward and backward
  (``cost.compute_s``); the probe's prediction is their sum over the block's ops (the loss that feeds
  the gradient in is left out).
* **measured**: ``out = block(*inputs); out.backward(dy)`` on the device, the median of ``--steps``
  timed calls after warm-ups, each ended by a device synchronize.
* **enqueued**: the same call ``--steps`` times back to back, one synchronize after the last, per call
  (``enqueued_s``): the host enqueues ahead as it does inside a training step, so a block whose lone
  call is host-bound (autograd's backward costs the host ~0.2-0.3 ms) shows its kernels' time here; on
  large blocks the two agree, unless the device slows under sustained load.

It also runs on CPU (``--device cpu``: small shapes, fp32, the ``cpu`` preset), which is how it is
tested without a GPU. Prints a table and writes JSON (every sample, each op's predicted seconds).
``--reprice FILE`` re-plans an earlier run's probes with today's cost model on any machine: how a
cost-model change moves the predictions of a measurement already taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.models.common import RMSNorm, lm_loss
from autopar.models.llama import apply_rope, grouped_causal_attention
from device_step import timed  # the benchmarks' timing loop (its warm-up calls left out)

PROBE_MODULE = "block"
"""The probed block's attribute in ``Probe``: the plan's ops under this module path are the block's."""


@dataclass(frozen=True)
class KernelProbe:
    """One building block: its family (``gemm``, ``attention``, ``bandwidth``, ``loss``), a name, the
    block and its example inputs (made on a device in a dtype), and the FLOPs of its forward and
    backward where they are well defined (GEMMs and attention), for an achieved TFLOP/s."""

    family: str
    name: str
    make: Callable[[str, torch.dtype], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    flops: float | None = None


class Probe(nn.Module):
    """Wraps a block so the plan names its ops by one module path (``PROBE_MODULE``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.block(*inputs)


class Attention(nn.Module):
    """Causal fused attention of ``q [b, nh, s, hd]`` and ``k, v [b, nkv, s, hd]`` as the built-in Llama runs it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return grouped_causal_attention(q, k, v)


class Rope(nn.Module):
    """The built-in Llama's rotary embedding of ``x [b, nh, s, hd]`` by ``[s, hd]`` tables."""

    def __init__(self, seq: int, head_dim: int) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), torch.ones(head_dim))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, self.cos.to(x.dtype), self.sin.to(x.dtype))


class SwiGLUGate(nn.Module):
    """SwiGLU's elementwise part, ``silu(a) * b``, between its GEMMs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class CrossEntropy(nn.Module):
    """The built-in models' loss (``lm_loss``) over ``logits [tokens, vocab]`` against fixed targets."""

    def __init__(self, targets: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("targets", targets, persistent=False)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, self.targets)


def _leaf(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True)


def gemm(m: int, k: int, n: int, note: str) -> KernelProbe:
    """``[m, k] @ [k, n]`` as ``nn.Linear(k, n, bias=False)``: forward, input and weight gradients."""

    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return nn.Linear(k, n, bias=False, device=device, dtype=dtype), (_leaf((m, k), device, dtype),)

    return KernelProbe("gemm", f"{m}x{k}x{n} {note}", make, flops=6.0 * m * k * n)


def attention(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, note: str) -> KernelProbe:
    """Causal fused attention; FLOPs as FlashAttention counts a causal kernel: forward ``2·2·b·h·s²·d / 2``,
    backward 2.5 times that (five products where forward has two)."""

    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        q = _leaf((batch, heads, seq, head_dim), device, dtype)
        k, v = (_leaf((batch, kv_heads, seq, head_dim), device, dtype) for _ in range(2))
        return Attention(), (q, k, v)

    forward = 2.0 * batch * heads * seq * seq * head_dim
    return KernelProbe("attention", f"b{batch} h{heads}/{kv_heads} s{seq} d{head_dim} {note}", make,
                       flops=forward * 3.5)


def rms_norm(tokens: int, hidden: int) -> KernelProbe:
    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return RMSNorm(hidden).to(device=device, dtype=dtype), (_leaf((tokens, hidden), device, dtype),)

    return KernelProbe("bandwidth", f"RMSNorm {tokens}x{hidden}", make)


def layer_norm(tokens: int, hidden: int) -> KernelProbe:
    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return nn.LayerNorm(hidden, device=device, dtype=dtype), (_leaf((tokens, hidden), device, dtype),)

    return KernelProbe("bandwidth", f"LayerNorm {tokens}x{hidden}", make)


def swiglu_gate(tokens: int, width: int) -> KernelProbe:
    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return SwiGLUGate(), (_leaf((tokens, width), device, dtype), _leaf((tokens, width), device, dtype))

    return KernelProbe("bandwidth", f"silu(a)*b {tokens}x{width}", make)


def rope(batch: int, heads: int, seq: int, head_dim: int) -> KernelProbe:
    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return Rope(seq, head_dim).to(device), (_leaf((batch, heads, seq, head_dim), device, dtype),)

    return KernelProbe("bandwidth", f"rope b{batch} h{heads} s{seq} d{head_dim}", make)


def cross_entropy(tokens: int, vocab: int) -> KernelProbe:
    def make(device: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        targets = torch.randint(0, vocab, (tokens,), device=device)
        return CrossEntropy(targets), (_leaf((tokens, vocab), device, dtype),)

    return KernelProbe("loss", f"cross-entropy {tokens}x{vocab}", make)


CUDA_PROBES: list[KernelProbe] = [
    gemm(16384, 4096, 4096, "Llama 3 8B q/o, 4x4096 tokens"),
    gemm(16384, 4096, 1024, "Llama 3 8B k/v (GQA)"),
    gemm(16384, 4096, 14336, "Llama 3 8B w1/w3"),
    gemm(16384, 14336, 4096, "Llama 3 8B w2"),
    gemm(16384, 4096, 128256, "Llama 3 head"),
    gemm(16384, 8192, 1024, "Llama 3 70B q at tp 8"),
    gemm(16384, 3584, 8192, "Llama 3 70B w2 at tp 8"),
    gemm(2048, 12288, 9216, "GPT-3 175B qkv at tp 4, 1x2048 tokens"),
    gemm(2048, 3072, 12288, "GPT-3 175B attention out at tp 4"),
    gemm(2048, 12288, 12288, "GPT-3 175B fc1 (and fc2) at tp 4"),
    gemm(4096, 4096, 4096, "cube"),
    gemm(2048, 1024, 1024, "small"),
    gemm(16384, 768, 3072, "GPT-2 small MLP, 16x1024 tokens"),
    gemm(16384, 768, 50257, "GPT-2 head (misaligned)"),
    attention(4, 32, 8, 4096, 128, "Llama 3 8B"),
    attention(1, 64, 8, 8192, 128, "Llama 3 70B, 8k"),
    attention(16, 12, 12, 1024, 64, "GPT-2 small"),
    attention(1, 24, 24, 2048, 128, "GPT-3 175B at tp 4"),
    rms_norm(16384, 4096),
    layer_norm(16384, 768),
    swiglu_gate(16384, 14336),
    rope(4, 32, 4096, 128),
    cross_entropy(16384, 32000),
    cross_entropy(16384, 128256),
]
CPU_PROBES: list[KernelProbe] = [
    gemm(256, 128, 128, "small"),
    attention(2, 4, 2, 64, 16, "small"),
    rms_norm(256, 128),
    cross_entropy(256, 512),
]


def predicted_ops(block: nn.Module, inputs: tuple[torch.Tensor, ...], cluster: str, dtype: str) -> dict[str, float]:
    """Each of the block's captured ops and its predicted forward + backward seconds on ``cluster``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = autopar.plan(Probe(block), inputs, cluster, _probe_loss, {"dtype": dtype},
                               example_targets=torch.ones((), device=inputs[0].device), name="kernel probe")
    ops = planned.to_dict()["ops"]
    return {name: op["cost"]["compute_s"] for name, op in ops.items()
            if op["module"] == PROBE_MODULE or op["module"].startswith(PROBE_MODULE + ".")}


def _probe_loss(out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (out.float() * scale).sum()


def measure(probe: KernelProbe, device: str, dtype: torch.dtype, cluster: str, steps: int) -> dict[str, Any]:
    """The probe's predicted and measured seconds (and TFLOP/s where its FLOPs are counted)."""
    block, inputs = probe.make(device, dtype)
    dtype_key = "bf16" if dtype == torch.bfloat16 else "fp32"
    ops = predicted_ops(block, inputs, cluster, dtype_key)
    grad = torch.randn_like(block(*inputs))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        for x in inputs:
            x.grad = None
        block.zero_grad(set_to_none=True)
        block(*inputs).backward(grad)

    samples = timed(step, sync, steps, align=lambda: None)  # one process: nothing to align
    row: dict[str, Any] = {"family": probe.family, "name": probe.name, "measured_s": statistics.median(samples),
                           "samples_s": samples, "enqueued_s": enqueued(step, sync, steps)}
    if probe.flops is not None:
        row["flops"] = probe.flops
        row["measured_tflops"] = probe.flops / row["measured_s"] / 1e12
        row["enqueued_tflops"] = probe.flops / row["enqueued_s"] / 1e12
    return priced(row, ops)


def enqueued(step: Callable[[], None], sync: Callable[[], None], calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``step`` issued back to back, synchronized once at the end."""
    step()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    sync()
    return (time.perf_counter() - start) / calls


def priced(row: dict[str, Any], ops: dict[str, float]) -> dict[str, Any]:
    """``row`` (a measured probe) with its prediction from ``ops``, its error and predicted TFLOP/s."""
    predicted = sum(ops.values())
    row = {**row, "predicted_s": predicted, "error": (predicted - row["measured_s"]) / row["measured_s"], "ops": ops}
    if "flops" in row:
        row["predicted_tflops"] = row["flops"] / predicted / 1e12 if predicted else None
    return row


def reprice(path: str) -> None:
    """Print an earlier run's measurements beside the predictions today's cost model makes for them
    (each block re-planned on meta tensors for that run's cluster: no GPU needed)."""
    data = json.loads(Path(path).read_text())
    probes = {p.name: p for p in (*CUDA_PROBES, *CPU_PROBES)}
    cpu = data["cluster"].endswith("cpu")
    dtype, dtype_key = (torch.float32, "fp32") if cpu else (torch.bfloat16, "bf16")
    rows = []
    for row in data["rows"]:
        if "error_text" in row or row["name"] not in probes:
            rows.append(row)
            continue
        block, inputs = probes[row["name"]].make("meta", dtype)
        rows.append(priced(row, predicted_ops(block, inputs, data["cluster"], dtype_key)))
    print_table(rows)


def preset_cluster(device: str) -> str:
    """``1x1x<preset>``: the catalog's figures for this machine's device."""
    if device == "cuda":
        from autopar.cost_models.hardware import preset_for_cuda_name

        return f"1x1x{preset_for_cuda_name(torch.cuda.get_device_name())}"
    return "1x1xcpu"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'family':<9} {'probe':<48} {'predicted':>10} {'measured':>10} {'error':>7} {'enqueued':>10} {'error':>7} "
          f"{'TFLOP/s pred':>12} {'meas':>6} {'enq':>6}")
    for r in rows:
        if "error_text" in r:
            print(f"{r['family']:<9} {r['name']:<48} failed: {r['error_text']}")
            continue
        tflops = [f"{r[key]:.0f}" if r.get(key) else "-" for key in ("predicted_tflops", "measured_tflops",
                                                                      "enqueued_tflops")]
        enqueued_s = r.get("enqueued_s")  # absent from runs before it was measured
        enqueued_text = (f"{enqueued_s * 1e3:>7.3f} ms {(r['predicted_s'] - enqueued_s) / enqueued_s * 100:>+6.0f}%"
                         if enqueued_s else f"{'-':>10} {'-':>7}")
        print(f"{r['family']:<9} {r['name']:<48} {r['predicted_s'] * 1e3:>7.3f} ms {r['measured_s'] * 1e3:>7.3f} ms "
              f"{r['error'] * 100:>+6.0f}% {enqueued_text} {tflops[0]:>12} {tflops[1]:>6} {tflops[2]:>6}")


def run(device: str, steps: int, out: Path, only: str | None = None) -> list[dict[str, Any]]:
    """Measure every probe (or those of family ``only``, or whose name contains it), writing the JSON after each."""
    probes = CUDA_PROBES if device == "cuda" else CPU_PROBES
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cluster = preset_cluster(device)
    rows: list[dict[str, Any]] = []
    for probe in probes:
        if only and only != probe.family and only not in probe.name:
            continue
        try:
            rows.append(measure(probe, device, dtype, cluster, steps))
        except Exception as exc:  # a benchmark reports every probe it could run, and why one failed
            rows.append({"family": probe.family, "name": probe.name, "error_text": f"{type(exc).__name__}: {exc}"})
        if device == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps({"cluster": cluster, "device": _device_name(device), "torch": torch.__version__,
                                   "rows": rows}, indent=2) + "\n")
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10, help="timed calls per probe (default 10)")
    parser.add_argument("--only", default=None,
                        help="probes of this family (gemm, attention, bandwidth, loss) or whose name contains this text")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_probe.json"))
    parser.add_argument("--reprice", default=None, metavar="FILE",
                        help="re-plan the probes of an earlier run's JSON with today's cost model (no GPU needed)")
    args = parser.parse_args(argv)
    if args.reprice:
        reprice(args.reprice)
        return
    out = Path(args.out)
    rows = run(args.device, args.steps, out, args.only)
    print_table(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
