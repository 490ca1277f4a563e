"""Export a Plan as a Python module that applies it with native PyTorch APIs (``autopar export``).

For: people who want to own their training script. The generated ``parallelize(model, world_mesh)``
uses only ``init_device_mesh``, ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``,
``fully_shard`` and ``DistributedDataParallel`` (no autopar import), and reads like a hand-written
torchtitan-style recipe that a person can edit.

Not for: running the plan collective by collective (autopar's own runtime does that). The native
styles say less than a plan can: what they cannot say is left replicated, and every such part is
listed in the notes ``export_plan`` returns (and in the generated module's docstring).

How a plan maps:

* mesh -> ``init_device_mesh(device_type, shape, mesh_dim_names=...)``;
* the ``tp`` dim -> one TP style per ``nn.Linear``/``nn.Embedding``, read from how the plan *computes*
  its matmul (``plan.ops``), not only from how it stores the weight: weight ``S(0)`` with the output
  split on features -> ``ColwiseParallel``; weight ``S(1)`` with a partial output -> ``RowwiseParallel``.
  A column split whose output reaches a row split of the same parent module through element-wise ops
  stays split between them; through attention split by heads, the attention module also runs with its
  local head count (``heads // tp``); otherwise it is gathered (``output_layouts=Replicate()``);
* the ``dp`` dim -> ``fully_shard`` per repeated block and then the root when the plan shards parameters
  on it (fsdp), else ``DistributedDataParallel(device_mesh=...)`` (which composes with TP DTensors on
  gloo; the composable ``replicate`` gives different gradients next to TP in torch 2.13);
* a ``tp`` dim on which the plan only stores weights split (computing every matmul on gathered
  weights) is sharded data parallelism in all but name -> ``fully_shard`` over it (HSDP with ``dp``).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from torch.distributed.tensor import Placement, Shard

from autopar.core.errors import BadInputError
from autopar.core.placement import Placements, placement_to_str, strs_to_placements
from autopar.core.plan import Plan
from autopar.passes.mixed_precision import TORCH_DTYPES

__all__ = ["export_plan"]

# ops in plan.ops that read a weight: op name -> (activation input, weight input, weight transposed?)
_WEIGHT_OPS = {
    "aten.addmm.default": ("linear", 1, 2, True),
    "aten.mm.default": ("linear", 0, 1, True),
    "aten.linear.default": ("linear", 0, 1, False),
    "aten.embedding.default": ("embedding", 1, 0, False),
}
# element-wise ops that run the same on local shards as on the whole tensor
_POINTWISE = {"gelu", "relu", "silu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg", "pow", "exp",
              "clone", "_to_copy", "dropout", "native_dropout", "alias", "detach"}
# shape ops the model may run between a head-split q/k/v and o_proj (with its local head count)
_ATTENTION_SHAPE_OPS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze",
                        "squeeze", "expand", "slice", "cat", "contiguous", "select", "split"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"}
_KNOWN_DIMS = ("dp", "tp")


# --------------------------------------------------------------------------- reading the plan

@dataclass(frozen=True)
class _Placed:
    """The plan's placement strings, parsed once: parameters, buffers and inputs by name, and each op's
    (inputs, outputs) by op name (an output that is not a tensor is None)."""

    params: dict[str, Placements]
    buffers: dict[str, Placements]
    inputs: dict[str, Placements]
    ops: dict[str, tuple[tuple[Placements, ...], tuple[Placements | None, ...]]]


def _placed(plan: Plan) -> _Placed:
    return _Placed(
        params={fqn: strs_to_placements(pls) for fqn, pls in plan.placements.items()},
        buffers={fqn: strs_to_placements(pls) for fqn, pls in plan.buffers.items()},
        inputs={name: strs_to_placements(spec["placements"]) for name, spec in plan.inputs.items()
                if "placements" in spec},
        ops={name: (tuple(strs_to_placements(p) for p in op.get("inputs", [])),
                    tuple(None if p is None else strs_to_placements(p) for p in op.get("outputs", [])))
             for name, op in plan.ops.items()},
    )


@dataclass(frozen=True)
class _WeightOp:
    """One op that reads a module's weight: placements per mesh dim, the weight in its module's layout."""

    module: str
    kind: str  # "linear" (weight [out, in]) | "embedding" (weight [vocab, dim])
    index: int  # position in plan.ops (graph order)
    act: Placements
    weight: Placements
    out: Placements

    @property
    def parent(self) -> str:
        return self.module.rpartition(".")[0]


def _transposed(p: Placement) -> Placement:
    return Shard(1 - p.dim) if p.is_shard() and p.dim in (0, 1) else p


def _weight_ops(plan: Plan, placed: _Placed) -> list[_WeightOp]:
    """The first weight-reading op of every module, in graph order."""
    found: dict[str, _WeightOp] = {}
    for index, (name, op) in enumerate(plan.ops.items()):
        spec = _WEIGHT_OPS.get(op.get("op", ""))
        module = op.get("module", "")
        inputs, outputs = placed.ops[name]
        if spec is None or not module or module in found or not outputs or outputs[0] is None:
            continue
        kind, a, w, transposed = spec
        if len(inputs) <= max(a, w):
            continue
        weight = tuple(_transposed(p) if transposed else p for p in inputs[w])
        found[module] = _WeightOp(module, kind, index, inputs[a], weight, outputs[0])
    return list(found.values())


def _op_base(op: dict[str, Any]) -> str:
    """``aten.gelu.default`` -> ``gelu``."""
    parts = op.get("op", "").split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _collapse(names: Iterable[str]) -> str:
    """``blocks.0.attn.q_proj, blocks.1.attn.q_proj`` -> ``blocks.*.attn.q_proj`` (readable notes)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(re.sub(r"\.\d+(?=\.)", ".*", n), []).append(n)
    return ", ".join(pattern if len(group) > 1 else group[0] for pattern, group in groups.items())


# --------------------------------------------------------------------------- the tp dim

@dataclass(frozen=True)
class _Style:
    """One ``parallelize_module`` entry: ColwiseParallel/RowwiseParallel and its keyword arguments."""

    cls: str  # "ColwiseParallel" | "RowwiseParallel"
    kwargs: tuple[tuple[str, str], ...] = ()

    def render(self) -> str:
        return f"{self.cls}({', '.join(f'{k}={v}' for k, v in self.kwargs)})"


@dataclass
class _TensorParallel:
    styles: dict[str, _Style] = field(default_factory=dict)  # module fqn -> style
    local_heads: list[str] = field(default_factory=list)  # attention modules run with heads // tp
    groups: dict[str, str] = field(default_factory=dict)  # parent module -> comment for its entries
    storage_only: list[str] = field(default_factory=list)  # weights stored split but computed gathered
    batch: list[str] = field(default_factory=list)  # computed batch-split on tp (data parallel inside tp)


def _role(w: _WeightOp, t: int) -> str:
    """How the plan computes ``w`` on mesh dim ``t``: col | row | replicated | batch | other."""
    act, weight, out = w.act[t], w.weight[t], w.out[t]
    on_features = out.is_shard() and out != Shard(0)  # split, but not on the batch
    if w.kind == "linear":
        if weight == Shard(0) and act.is_replicate() and on_features:
            return "col"
        if weight == Shard(1) and act.is_shard() and act != Shard(0) and out.is_partial():
            return "row"
    else:
        if weight == Shard(1) and act.is_replicate() and on_features:
            return "col"
        if weight == Shard(0) and act.is_replicate() and out.is_partial():
            return "row"
    if act.is_replicate() and weight.is_replicate() and out.is_replicate():
        return "replicated"
    if act == Shard(0) and weight.is_replicate():
        return "batch"
    return "other"


def _pair_kind(plan: Plan, placed: _Placed, ops: list[_WeightOp], roles: dict[str, str], col: _WeightOp, t: int
               ) -> tuple[str, _WeightOp | None, str]:
    """Does column split ``col`` feed a row split of the same parent with its output kept split?

    Returns (kind, row, attention module): kind is ``local`` (element-wise ops between), ``heads``
    (attention split by heads between) or ``none``.
    """
    linear_modules = {w.module for w in ops}
    later = [w for w in ops if w.index > col.index]
    row = None
    for w in later:
        if w.kind == "linear" and w.parent == col.parent and roles[w.module] == "col":
            continue
        if w.kind == "linear" and w.parent == col.parent and roles[w.module] == "row":
            row = w
        break
    if row is None:
        return "none", None, ""
    between = [name for name in list(plan.ops)[col.index + 1:row.index]
               if plan.ops[name].get("module", "") not in linear_modules]
    outs = [o[t] for name in between for o in placed.ops[name][1] if o is not None]
    if any(not p.is_shard() for p in outs):
        return "none", row, ""  # the plan itself gathers between them
    bases = {_op_base(plan.ops[name]) for name in between}
    if bases <= _POINTWISE:
        return "local", row, ""
    attention = [name for name in between if _op_base(plan.ops[name]) in _ATTENTION]
    heads_split = attention and all(inp[t] == Shard(1) for name in attention for inp in placed.ops[name][0][:3])
    if heads_split and bases <= _POINTWISE | _ATTENTION_SHAPE_OPS | _ATTENTION:
        return "heads", row, plan.ops[attention[0]].get("module", "")
    return "none", row, ""


def _tensor_parallel(plan: Plan, placed: _Placed, ops: list[_WeightOp], t: int, notes: list[str]) -> _TensorParallel:
    tp = _TensorParallel()
    if not ops and any(op.get("op") in _WEIGHT_OPS for op in plan.ops.values()):
        notes.append("the plan's ops name no modules (a plan from an older autopar): TP styles cannot be "
                     "derived from them; re-plan to export tensor parallelism")
    roles = {w.module: _role(w, t) for w in ops}
    tied = [w.module for w in ops if f"{w.module}.weight" not in plan.placements]
    if tied:
        notes.append(f"{_collapse(tied)} use a weight held by another module (tied): TP of every "
                     "embedding and of these modules is left replicated")
        for w in ops:
            if w.module in tied or w.kind == "embedding":
                roles[w.module] = "replicated"
    fed_rows: set[str] = set()
    split_cols: set[str] = set()
    for w in ops:
        if roles[w.module] != "col" or w.kind != "linear":
            continue
        kind, row, attn = _pair_kind(plan, placed, ops, roles, w, t)
        if kind == "none":
            continue
        split_cols.add(w.module)
        fed_rows.add(row.module)
        if kind == "heads":
            if attn not in tp.local_heads:
                tp.local_heads.append(attn)
            tp.groups[w.parent] = "q/k/v split by heads (this rank runs heads // tp of them), o_proj by rows"
        else:
            tp.groups.setdefault(w.parent, "column -> row pair: activations stay split between them")
    for w in ops:
        style = _style(roles[w.module], w.module in split_cols, w.module in fed_rows)
        if style is not None:
            tp.styles[w.module] = style
    _tp_notes(placed, ops, roles, split_cols, t, tp, notes)
    return tp


def _style(role: str, keeps_split: bool, fed_split: bool) -> _Style | None:
    replicate = "Replicate()"
    if role == "col":
        return _Style("ColwiseParallel", () if keeps_split else (("output_layouts", replicate),))
    if role == "row":
        return _Style("RowwiseParallel", () if fed_split else (("input_layouts", replicate),))
    return None


def _tp_notes(placed: _Placed, ops: list[_WeightOp], roles: dict[str, str], split_cols: set[str], t: int,
              tp: _TensorParallel, notes: list[str]) -> None:
    stored_split = lambda w: not _whole_on(placed.params.get(f"{w.module}.weight"), t, True)  # noqa: E731
    tp.storage_only = [w.module for w in ops if roles[w.module] in ("replicated", "batch") and stored_split(w)]
    batch = tp.batch = [w.module for w in ops if roles[w.module] == "batch"]
    other = [w.module for w in ops if roles[w.module] == "other"]
    gathered = [w.module for w in ops if roles[w.module] == "col" and w.module not in split_cols
                and w.kind == "linear"]
    if tp.local_heads:
        notes.append(f"attention {_collapse(tp.local_heads)} runs heads // tp heads per rank: the generated "
                     "code divides the module's head-count attributes (check HEAD_COUNT_ATTRS for your model)")
    if batch:
        notes.append(f"the plan splits the batch of {_collapse(batch)} over the tp ranks (data parallel "
                     "inside tp); native TP has no such style: every tp rank computes the whole batch")
    if other:
        notes.append(f"the tp split the plan computes for {_collapse(other)} has no native TP style: replicated")
    if gathered:
        notes.append(f"the column-split output of {_collapse(gathered)} is gathered right after it "
                     "(ColwiseParallel(output_layouts=Replicate())) where the plan keeps it split; for logits "
                     "into the loss, use_local_output=False with loss_parallel() would keep them split")
    col_bias = [w.module for w in ops if tp.styles.get(w.module, _Style("")).cls == "ColwiseParallel"
                and _whole_on(placed.params.get(f"{w.module}.bias"), t, False)]
    if col_bias:
        notes.append(f"ColwiseParallel also splits the bias of {_collapse(col_bias)} (the plan keeps it replicated)")
    styled = {f"{m}.{p}" for m in tp.styles for p in ("weight", "bias")}
    loose = [fqn for fqn, pls in placed.params.items() if pls[t].is_shard() and fqn not in styled
             and fqn.rpartition(".")[0] not in tp.storage_only]
    if loose:
        notes.append(f"parameters {_collapse(loose)} are stored split on tp in the plan; "
                     "no native TP style splits them: replicated")


def _whole_on(placements: Placements | None, d: int, absent: bool) -> bool:
    """Whether a tensor placed so is replicated on mesh dim ``d`` (``absent``: the answer for a tensor the
    plan does not place)."""
    return absent if placements is None else placements[d].is_replicate()


# --------------------------------------------------------------------------- the dp dim

@dataclass
class _DataParallel:
    kind: str = "none"  # none | ddp | fsdp
    mesh_dims: tuple[str, ...] = ()  # mesh dims fully_shard / DDP run over
    blocks: str = ""  # container of repeated blocks wrapped one by one (fsdp)
    mixed_precision: tuple[str, str] | None = None  # torch dtype names (param, reduce) of FSDP's MixedPrecisionPolicy


def _repeated_container(fqns: Iterable[str]) -> str:
    """``blocks`` for ``blocks.0.attn...``: the module list whose children repeat (FSDP units)."""
    counts: dict[str, set[str]] = {}
    for fqn in fqns:
        m = re.match(r"^(.+?)\.(\d+)\.", fqn)
        if m:
            counts.setdefault(m.group(1), set()).add(m.group(2))
    return max(counts, key=lambda c: len(counts[c]), default="")


def _data_parallel(plan: Plan, placed: _Placed, ops: list[_WeightOp], tp: _TensorParallel | None,
                   notes: list[str]) -> _DataParallel:
    """How data parallelism is exported, with FSDP's ``MixedPrecisionPolicy`` for a mixed-precision plan
    (native PyTorch has no such policy for DDP or tensor parallelism: a note says so)."""
    dp = _data_parallel_kind(plan, placed, ops, tp, notes)
    pr = plan.precision
    if not pr.mixed:
        if pr.master != "fp32":
            notes.append(f"master weights in {pr.master}: parameters, gradients and optimizer state are "
                         f"{pr.master}, as priced; cast the model with model.to({TORCH_DTYPES[pr.master]}) "
                         "before this")
        return dp
    if dp.kind == "fsdp":
        return replace(dp, mixed_precision=(str(TORCH_DTYPES[pr.compute]).removeprefix("torch."),
                                            str(TORCH_DTYPES[pr.reduce]).removeprefix("torch.")))
    notes.append(f"mixed precision ({pr.compute} compute, {pr.master} master weights, gradients reduced in "
                 f"{pr.reduce}) is exported for FSDP only: train the {pr.master} model under "
                 f"torch.autocast(dtype=torch.{str(TORCH_DTYPES[pr.compute]).removeprefix('torch.')}) instead")
    return dp


def _data_parallel_kind(plan: Plan, placed: _Placed, ops: list[_WeightOp], tp: _TensorParallel | None,
                        notes: list[str]) -> _DataParallel:
    names = plan.mesh["dim_names"]
    has_dp = "dp" in names
    dp_sharded = has_dp and (plan.degrees.get("fsdp", 1) > 1 or any(
        pls[names.index("dp")].is_shard() for pls in placed.params.values()))
    tp_as_fsdp = tp is not None and not tp.styles and bool(tp.storage_only)
    blocks = _repeated_container(plan.placements)
    if has_dp:
        _dp_notes(plan, placed, ops, names.index("dp"), notes)
    gathered = [m for m in tp.storage_only if m not in tp.batch] if tp is not None else []
    if gathered and not tp_as_fsdp:
        notes.append(f"{_collapse(gathered)} are stored split on tp but computed on gathered weights "
                     "in the plan (sharded data parallelism inside tp): replicated")
    if tp_as_fsdp and dp_sharded:
        notes.append("the plan stores weights split on both dp and tp while computing on tp replicated; "
                     "fully_shard runs over dp only, weights are replicated over tp")
        tp_as_fsdp = False
    if tp_as_fsdp:
        notes.append(f"the tp dim only stores weights split ({_collapse(tp.storage_only)}) and computes every "
                     "matmul on gathered weights: that is FSDP, so fully_shard runs over tp "
                     "(every tp rank takes the same batch; fully_shard also splits norms and biases)")
        return _DataParallel("fsdp", ("dp", "tp") if has_dp else ("tp",), blocks)
    if dp_sharded:
        return _DataParallel("fsdp", ("dp",), blocks)
    return _DataParallel("ddp", ("dp",)) if has_dp else _DataParallel()


def _dp_notes(plan: Plan, placed: _Placed, ops: list[_WeightOp], d: int, notes: list[str]) -> None:
    unsplit = [name for name, pls in placed.inputs.items() if pls[d] != Shard(0)]
    if unsplit:
        notes.append(f"the plan does not split inputs {', '.join(unsplit)} over dp; here every input is split "
                     "over dp on dim 0 (local_batch)")
    odd = [w.module for w in ops if not w.weight[d].is_replicate()]
    if odd:
        notes.append(f"on the dp dim the plan computes {_collapse(odd)} with split weights; "
                     "native data parallelism computes them batch-split on whole (gathered) weights")
    if plan.degrees.get("fsdp", 1) > 1:
        layouts = {pls[d] for pls in placed.params.values()}
        if layouts != {Shard(0)}:
            notes.append(f"fully_shard splits every parameter on dim 0 over dp; the plan's per-parameter "
                         f"dp layouts are {', '.join(sorted(map(placement_to_str, layouts)))}")


# --------------------------------------------------------------------------- plan-wide notes

def _plan_notes(plan: Plan, placed: _Placed) -> list[str]:
    notes = []
    degrees, pipe = plan.degrees, plan.pipeline
    if degrees.get("pp", 1) > 1:
        notes.append(f"pipeline parallelism (pp={degrees['pp']}, schedule {pipe.get('schedule')}, stages "
                     f"{pipe.get('stages')}) is not exported: split the model with torch.distributed.pipelining")
    for key, what in (("cp", "context parallelism"), ("ep", "expert parallelism")):
        if degrees.get(key, 1) > 1:
            notes.append(f"{what} ({key}={degrees[key]}) is not exported")
    if plan.precision.fp8 is not None:
        notes.append(f"float8 linears ({plan.precision.fp8} scaling) are not exported: native PyTorch has no float8 "
                     "training of its own; torchao's convert_to_float8_training runs the same recipe on the layers' "
                     "nn.Linear modules, with each rank's own amax of a split activation where autopar takes the "
                     "whole tensor's")
    if degrees.get("sp", 1) > 1:
        notes.append(f"sequence parallelism (sp={degrees['sp']}: norms and residuals split on the sequence) is "
                     "not exported: they run replicated on tp (SequenceParallel() would need matching layouts)")
    if pipe.get("microbatches", 1) > 1:
        notes.append(f"gradient accumulation over {pipe['microbatches']} microbatches of "
                     f"{pipe.get('microbatch_size')} is the training loop's job (see the docstring)")
    if degrees.get("zero", 0) in (1, 2):
        notes.append(f"ZeRO-{degrees['zero']} (optimizer state{' and gradients' if degrees['zero'] == 2 else ''} "
                     "sharded over dp, parameters replicated) is exported as plain data parallelism: shard the "
                     "optimizer with torch.distributed.optim.ZeroRedundancyOptimizer")
    if plan.checkpointing not in ("none", "", None):
        notes.append(f"activation checkpointing ({plan.checkpointing}) is not exported: wrap blocks with "
                     "torch.utils.checkpoint yourself")
    other_dims = [n for n in plan.mesh["dim_names"] if n not in _KNOWN_DIMS]
    if other_dims:
        notes.append(f"mesh dims {', '.join(other_dims)} have no native mapping here: replicated over them")
    sharded_buffers = [b for b, pls in placed.buffers.items() if any(p.is_shard() for p in pls)]
    if sharded_buffers:
        notes.append(f"buffers {_collapse(sharded_buffers)} are split in the plan: replicated here")
    return notes


# --------------------------------------------------------------------------- rendering

class _Code:
    """Lines of Python with an indentation cursor."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, *lines: str) -> "_Code":
        for line in lines:
            self.lines.append(("    " * self.depth + line) if line else "")
        return self

    def indent(self, n: int = 1) -> "_Code":
        self.depth += n
        return self

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


def _header(plan: Plan, notes: list[str], dp: _DataParallel) -> list[str]:
    m, c, deg, pipe, pred = plan.model, plan.cluster, plan.degrees, plan.pipeline, plan.predicted
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["dim_names"], plan.mesh["shape"]))
    degrees = " ".join(f"{k}={v}" for k, v in deg.items())
    lines = [
        f'"""Apply the autopar plan for {m.get("name", "?")} on {c.get("spec", "?")} with native PyTorch APIs.',
        "",
        "Generated by `autopar export`; edit freely. It imports torch only, not autopar.",
        "",
        f"    model     {m.get('name', '?')}: {m.get('params', 0):,} parameters, {m.get('layers', '?')} layers",
        f"    cluster   {c.get('spec', '?')}: {c.get('devices', '?')} devices",
        f"    mesh      {mesh}",
        f"    degrees   {degrees}",
        f"    pipeline  {pipe.get('microbatches', 1)} microbatch(es) of {pipe.get('microbatch_size', '?')}, "
        f"schedule {pipe.get('schedule', 'none')}",
    ]
    if isinstance(pred.get("step_time_s"), (int, float)):
        lines.append(f"    predicted {pred['step_time_s'] * 1e3:.3g} ms/step, MFU {pred.get('mfu', 0):.1%}")
    lines += ["", "Use (on every rank, after torch.distributed.init_process_group):", "",
              "    mesh = build_mesh()",
              "    model = parallelize(model, mesh)",
              "    optimizer = torch.optim.AdamW(model.parameters())",
              "    for inputs, targets in loader:                  # the global batch, the same on every rank",
              "        inputs, targets = local_batch(inputs, mesh), local_batch(targets, mesh)",
              "        loss = loss_fn(model(inputs), targets)      # the mean over this rank's slice"]
    if pipe.get("microbatches", 1) > 1:
        n = pipe["microbatches"]
        sync = "model.no_sync()" if dp.kind == "ddp" else "model.set_requires_gradient_sync(False)"
        lines += [f"        # the plan accumulates gradients over {n} microbatches: run {n} forward/backward",
                  f"        # passes on chunks of the slice, each loss weighted by its share of the batch's: 1/{n}",
                  f"        # for a mean, its share of the counted targets for a padded one ({sync} but for the last)"]
    lines += ["        loss.backward()", "        optimizer.step()", "        optimizer.zero_grad()"]
    if notes:
        lines += ["", "Not expressed with native APIs (kept replicated or left to the training loop):"]
        for note in notes:
            lines += textwrap.wrap(note, 104, initial_indent="  - ", subsequent_indent="    ",
                                   break_on_hyphens=False, break_long_words=False)
    return [line.rstrip() for line in lines] + ['"""']


def _imports(tp: _TensorParallel | None, dp: _DataParallel) -> list[str]:
    lines = ["from __future__ import annotations", "", "import torch", "from torch import nn",
             "from torch.distributed.device_mesh import DeviceMesh, init_device_mesh"]
    if dp.kind == "fsdp":
        lines.append("from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard" if dp.mixed_precision
                     else "from torch.distributed.fsdp import fully_shard")
    if tp is not None and tp.styles:
        if any("Replicate()" in s.render() for s in tp.styles.values()):
            lines.append("from torch.distributed.tensor import Replicate")
        lines.append("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, "
                     "parallelize_module")
    if dp.kind == "ddp":
        lines.append("from torch.nn.parallel import DistributedDataParallel")
    return lines


def _split_by_block(styles: dict[str, _Style], blocks: str) -> tuple[dict[str, _Style] | None, dict[str, _Style]]:
    """Styles inside ``blocks.N.`` as one per-block dict when every block has the same ones."""
    per_block: dict[str, dict[str, _Style]] = {}
    rest: dict[str, _Style] = {}
    for fqn, style in styles.items():
        m = re.match(rf"^{re.escape(blocks)}\.(\d+)\.(.+)$", fqn) if blocks else None
        if m:
            per_block.setdefault(m.group(1), {})[m.group(2)] = style
        else:
            rest[fqn] = style
    shared = next(iter(per_block.values()), None)
    if shared is None or any(d != shared for d in per_block.values()):
        return None, styles
    return shared, rest


def _render_styles(code: _Code, target: str, styles: dict[str, _Style], groups: dict[str, str],
                   prefix: str) -> None:
    code(f"parallelize_module({target}, tp_mesh, {{")
    code.indent()
    last_group = None
    for fqn, style in styles.items():
        group = (prefix + fqn).rpartition(".")[0]
        if group != last_group and group in groups:
            code(f"# {fqn.rpartition('.')[0]}: {groups[group]}")
        last_group = group
        code(f'"{fqn}": {style.render()},')
    code.indent(-1)
    code("})")


def _render_tp(code: _Code, plan: Plan, tp: _TensorParallel, blocks: str) -> None:
    size = plan.mesh["shape"][plan.mesh["dim_names"].index("tp")]
    code("", "", "def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:")
    code.indent()
    code(f'"""Megatron-style column/row splits over the tp mesh dim ({size} ranks), in place."""')
    shared, rest = _split_by_block(tp.styles, blocks)
    if shared:
        code(f'for block in model.get_submodule("{blocks}"):')
        code.indent()
        first = next(fqn for fqn in tp.styles if fqn.startswith(blocks + "."))
        prefix = re.match(rf"^{re.escape(blocks)}\.\d+\.", first).group(0)
        _render_styles(code, "block", shared, tp.groups, prefix)
        for attn in _block_relative(tp.local_heads, blocks):
            code(f'use_local_heads(block.get_submodule("{attn}"), tp_mesh.size())')
        code.indent(-1)
    if rest:
        _render_styles(code, "model", rest, tp.groups, "")
    heads_outside = tp.local_heads if not shared else [a for a in tp.local_heads if not a.startswith(blocks + ".")]
    for attn in heads_outside:
        code(f'use_local_heads(model.get_submodule("{attn}"), tp_mesh.size())')
    code.indent(-1)


def _block_relative(fqns: list[str], blocks: str) -> list[str]:
    out: list[str] = []
    for fqn in fqns:
        m = re.match(rf"^{re.escape(blocks)}\.\d+\.(.+)$", fqn)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def _render_heads_helper(code: _Code) -> None:
    code("", "", 'HEAD_COUNT_ATTRS = ("heads", "kv_heads", "n_heads", "n_kv_heads", "num_heads", '
         '"num_kv_heads", "num_key_value_heads")',
         '"""Attributes an attention module reshapes q/k/v with; edit for your model."""',
         "", "",
         "def use_local_heads(attention: nn.Module, tp: int) -> None:")
    code.indent()
    code('"""q/k/v are split by heads over tp, so the module must reshape with its local head counts."""',
         "names = [n for n in HEAD_COUNT_ATTRS if isinstance(getattr(attention, n, None), int)]",
         "if not names:")
    code.indent()
    code("raise AttributeError(f\"{type(attention).__name__} has none of {HEAD_COUNT_ATTRS}: \"",
         "                     f\"set its head counts to heads // {tp} by hand\")")
    code.indent(-1)
    code("for name in names:")
    code.indent()
    code("heads = getattr(attention, name)", "if heads % tp:")
    code.indent()
    code('raise ValueError(f"{name}={heads} does not split over tp={tp}")')
    code.indent(-1)
    code("setattr(attention, name, heads // tp)")
    code.indent(-2)


def _render_dp(code: _Code, dp: _DataParallel) -> None:
    dims = dp.mesh_dims
    if dp.kind == "ddp":
        code("", "", "def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:")
        code.indent()
        code('"""Replicate parameters over dp and average gradients (DDP); returns the wrapper."""',
             "return DistributedDataParallel(model, device_mesh=dp_mesh)")
        code.indent(-1)
        return
    what = "HSDP: replicated over dp, sharded over tp" if len(dims) == 2 else f"sharded over {dims[0]}"
    code("", "", "def apply_fsdp(model: nn.Module, fsdp_mesh: DeviceMesh) -> None:")
    code.indent()
    code(f'"""FSDP ({what}): each block gathers its parameters just before use, in place."""')
    policy = ""
    if dp.mixed_precision:
        compute, reduce = dp.mixed_precision
        code(f"policy = MixedPrecisionPolicy(param_dtype=torch.{compute}, reduce_dtype=torch.{reduce})")
        policy = ", mp_policy=policy"
    if dp.blocks:
        code(f'for block in model.get_submodule("{dp.blocks}"):')
        code.indent()
        code(f"fully_shard(block, mesh=fsdp_mesh{policy})")
        code.indent(-1)
    code(f"fully_shard(model, mesh=fsdp_mesh{policy})")
    code.indent(-1)


def _tuple(items: tuple) -> str:
    """A tuple literal with double-quoted strings, as the rest of the generated code."""
    parts = [f'"{x}"' if isinstance(x, str) else str(x) for x in items]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _render_entry(code: _Code, plan: Plan, tp: _TensorParallel | None, dp: _DataParallel) -> None:
    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["dim_names"])
    code("", "", f"MESH_SHAPE = {_tuple(shape)}", f"MESH_DIM_NAMES = {_tuple(names)}", "", "",
         "def build_mesh() -> DeviceMesh:")
    code.indent()
    code('"""The plan\'s device mesh over all ranks of the current process group."""',
         'device_type = "cuda" if torch.cuda.is_available() else "cpu"',
         "return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)")
    code.indent(-1)
    code("", "", "def parallelize(model: nn.Module, world_mesh: DeviceMesh | None = None) -> nn.Module:")
    code.indent()
    code('"""Shard ``model`` as the plan says (call it on every rank); returns the module to train."""',
         "world_mesh = world_mesh if world_mesh is not None else build_mesh()")
    if tp is not None and tp.styles:
        code('apply_tensor_parallel(model, world_mesh["tp"])')
    if dp.kind == "fsdp":
        mesh = f'world_mesh["{dp.mesh_dims[0]}"]' if len(dp.mesh_dims) == 1 else \
            "world_mesh[" + ", ".join(f'"{d}"' for d in dp.mesh_dims) + "]"
        code(f"apply_fsdp(model, {mesh})")
    elif dp.kind == "ddp":
        code('model = apply_data_parallel(model, world_mesh["dp"])')
    code("return model")
    code.indent(-1)
    code("", "", "def local_batch(batch: torch.Tensor, world_mesh: DeviceMesh) -> torch.Tensor:")
    code.indent()
    if "dp" in names:
        code('"""This rank\'s slice of a global batch: split over the dp ranks on dim 0, whole on the others."""',
             'dp_mesh = world_mesh["dp"]',
             "return torch.chunk(batch, dp_mesh.size(), dim=0)[dp_mesh.get_local_rank()]")
    else:
        code('"""This rank\'s slice of a global batch: the mesh has no dp dim, so the whole batch."""',
             "return batch")
    code.indent(-1)


def export_plan(plan: Plan) -> tuple[str, list[str]]:
    """Python source defining ``parallelize(model, world_mesh=None)`` for ``plan``, and notes on the parts
    of the plan that native PyTorch APIs cannot express (left replicated or to the training loop)."""
    if "dp_replicate" in plan.mesh["dim_names"]:
        raise BadInputError("HSDP plans (mesh dim dp_replicate) are not exported yet: pass the 2-D mesh "
                            "mesh['dp_replicate', 'dp'] to fully_shard and split the batch over both dims by hand")
    placed = _placed(plan)
    notes = _plan_notes(plan, placed)
    ops = _weight_ops(plan, placed)
    names = plan.mesh["dim_names"]
    tp = _tensor_parallel(plan, placed, ops, names.index("tp"), notes) if "tp" in names else None
    dp = _data_parallel(plan, placed, ops, tp, notes)
    code = _Code()
    code(*_header(plan, notes, dp), "", *_imports(tp, dp))
    _render_entry(code, plan, tp, dp)
    if tp is not None and tp.styles:
        _render_tp(code, plan, tp, _repeated_container(plan.placements))
        if tp.local_heads:
            _render_heads_helper(code)
    if dp.kind != "none":
        _render_dp(code, dp)
    return code.text(), notes
