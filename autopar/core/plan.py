"""``Plan``: the frozen, versioned, JSON-serializable contract between the solver and the rewrite passes.

A plan says, for one model on one cluster, the device mesh, the parallel degrees, where every parameter
and input lives (``S(d)``/``R`` per mesh dim), which strategy every graph node runs, and what the cost
model predicts. It is data only: ``passes`` read it to build the per-rank program, ``show``/``compare``
read it to explain it, and nothing in it needs torch to load. Schema ``autopar.plan/1`` (docs/architecture.md "Plan JSON").
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, TypeVar

from autopar.core.axes import MeshAxis
from autopar.core.errors import PlanFormatError
from autopar.core.files import read_text, write_atomically
from autopar.core.placement import str_to_placement

SCHEMA = "autopar.plan/1"
CHECKPOINTING = ("none", "core_attention", "selective", "save_dot_except_mlpwi", "full")
"""Activation checkpointing modes of a repeated layer, from the least recomputation to the most (priced in
``stages.py``, run by ``passes/checkpoint.py``): ``core_attention`` is Megatron-LM's selective recomputation
(the attention core alone), ``selective`` PyTorch's (every op but linear layers and fused attention),
``save_dot_except_mlpwi`` MaxText's policy of that name (selective, an MLP's input projections recomputed too)."""
SELECTIVE_MODES = ("selective", "save_dot_except_mlpwi")
"""Modes run by torch's selective activation checkpointing over a whole layer, keeping kept-list ops' outputs."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
"""Pipeline schedules a plan may name (priced in ``cost_models/pipeline.py``, run by ``runtime/pipeline.py``):
``zero_bubble`` is torch's ``ScheduleInterleavedZeroBubble`` (Qi et al., ICLR 2024), one or more chunks a device."""
MULTI_CHUNK_SCHEDULES = ("interleaved", "zero_bubble")
"""Schedules that may run several model chunks (``virtual_stages``) per device."""
MIXED = "mixed"
"""``checkpointing`` of a plan whose layers run in different modes, listed in ``recomputed_layers``."""
CONTIGUOUS, LOAD_BALANCED = "contiguous", "load_balanced"
CP_LAYOUTS = (CONTIGUOUS, LOAD_BALANCED)
"""How a sequence split over cp lies on its ranks (``cp_layout``): rank r holds chunk r of cp (plans
before load balancing), or chunks r and 2cp-1-r of 2cp, even causal work (``passes/sequence_layout.py``)."""
ALLGATHER, RING = "allgather", "ring"
CP_ATTENTIONS = (ALLGATHER, RING)
"""How fused attention runs over a sequence split on cp (``cp_attention``): its keys and values all-gathered
before it (Llama 3's context parallelism; plans before the ring), or passed around the cp ring inside it
(``passes/ring_attention.py``). The planner prices both per op and the ILP picks; the ops' placements say
which each runs (keys split on the sequence over cp: the ring), and this key says what they chose."""
DTENSOR, LOWERED = "dtensor", "lowered"
RUNTIMES = (DTENSOR, LOWERED)
"""The runtime a plan's prediction assumes (``predicted.runtime``): DTensor's per-op dispatch
(``autoparallelize(..., lowered=False)``), whose collectives run where each op needs them, or the lowered
program (``passes/lower.py``, ``autoparallelize``'s default where it runs the plan), which launches each
layer's FSDP gradient reduce_scatter as soon as its gradients exist and waits on it when backward ends, and
issues its backward regathers a layer ahead. The planner prices each mesh for the runtime that runs its plans
by default (``planning/roles.priced_runtime``) unless constraint ``runtime`` pins one. Plans without the key
assumed DTensor."""
MEMORY_STAGES = ("first", "last")
"""A pipeline's memory rows (``predicted.memory_stage``, ``stage_peak_memory_bytes``): the first stage's
device, with the embedding and the most microbatches in flight, and the last's, with the head and loss."""
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "gathered")
"""The parts of ``predicted.memory_bytes``, bytes per device that add up to ``peak_memory_bytes``: the local
parameter shards, their gradients, the optimizer state, the activations held for backward (with the largest
op's working set), and, only where the plan shards parameters over data parallelism (FSDP, ZeRO-3), the
largest unit of them gathered whole, twice: the unit running and the next gathered ahead
(``planning/problem.gathered_units``; plans made before it was priced lack it)."""
_AXIS_NAMES = tuple(axis.value for axis in MeshAxis)
_REQUIRED = ("schema", "model", "cluster", "mesh", "degrees", "pipeline", "checkpointing", "placements",
             "ops", "predicted", "solver")


# ---- typed sections ---------------------------------------------------------------------------------
_S = TypeVar("_S", bound="_Section")


class _Section(Mapping[str, Any]):
    """A plan section as typed attributes that also reads as the JSON object it is written as: an
    optional key the plan leaves out is ``None`` and absent from the mapping, so a plan's JSON is the
    same whether it was made here or loaded from a file. Keys this version does not know are kept
    (``extra``), so a round trip through an older autopar loses nothing."""

    extra: Mapping[str, Any]
    _required: ClassVar[tuple[str, ...]]

    @classmethod
    def parse(cls: type[_S], data: Any, source: str) -> _S:
        """The section from its JSON object, each key checked; ``PlanFormatError`` names the bad one."""
        if isinstance(data, cls):
            return data
        name = cls.json_name
        if not isinstance(data, Mapping):
            raise PlanFormatError(f"{source}: '{name}' must be a JSON object, got {type(data).__name__}")
        missing = [k for k in cls._required if data.get(k) is None]
        if missing:
            raise PlanFormatError(f"{source}: {name} is missing {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        section = cls(**{k: v for k, v in data.items() if k in known},
                      extra={k: v for k, v in data.items() if k not in known})
        section.check(source)
        return section

    def check(self, source: str) -> None:
        """Raise ``PlanFormatError`` naming the first key whose value this section cannot hold."""

    def _keys(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "extra" and getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._keys(), *self.extra])

    def __len__(self) -> int:
        return len(self._keys()) + len(self.extra)

    def to_json(self) -> dict[str, Any]:
        return {k: _json_value(self[k]) for k in self}


def _json_value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def _positive_int(source: str, key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanFormatError(f"{source}: {key} must be a positive integer, got {value!r}")


@dataclass(frozen=True, eq=False, kw_only=True)
class Mesh(_Section):
    """One pipeline stage's device mesh: a size and a name per dim (``MeshAxis`` values)."""

    shape: list[int]
    dim_names: list[str]
    extra: Mapping[str, Any] = field(default_factory=dict)
    json_name: ClassVar[str] = "mesh"
    _required: ClassVar[tuple[str, ...]] = ("shape", "dim_names")

    def check(self, source: str) -> None:
        if not isinstance(self.shape, list) or not isinstance(self.dim_names, list) \
                or len(self.shape) != len(self.dim_names) \
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in self.shape):
            raise PlanFormatError(f"{source}: mesh needs 'shape' (positive ints) and 'dim_names' lists of equal "
                                  "length")
        names = [n for n in self.dim_names if isinstance(n, str) and n in _AXIS_NAMES]
        if len(set(names)) != len(self.dim_names):
            raise PlanFormatError(f"{source}: mesh.dim_names must be distinct names among {', '.join(_AXIS_NAMES)}, "
                                  f"got {_short(self.dim_names)}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        """The size of mesh dim ``axis``; 1 when the mesh has no such dim (a dropped size-1 dim)."""
        return self.shape[self.dim_names.index(axis)] if axis in self.dim_names else 1


@dataclass(frozen=True, eq=False, kw_only=True)
class Degrees(_Section):
    """How many ways each kind of parallelism splits the work (docs/architecture.md "Plan JSON")."""

    dp: int  # the data-parallel ranks of a stage, each on its own share of the batch (dp_replicate x fsdp x ep)
    fsdp: int  # the size of the group parameters are sharded over (mesh dims "dp", "cp"); 1 when replicated.
    #            Not the ZeRO stage that constraint fsdp pins: that is ``zero``
    tp: int  # tensor-parallel ranks (mesh dim "tp")
    sp: int  # tp when the norms run split on the sequence over tp (sequence parallelism), else 1
    cp: int  # context-parallel ranks (mesh dim "cp"): each sequence split over them
    ep: int  # expert-parallel ranks (mesh dim "ep"): a data-parallel dim over which expert weights are split
    pp: int  # pipeline stages (the runtime's outermost mesh dim "pp"; ``Plan.mesh`` is one stage's)
    dp_replicate: int | None = None  # HSDP's replica groups (mesh dim "dp_replicate"); 1 without HSDP
    zero: int | None = None  # the ZeRO stage: 1 or 2 (optimizer state, and gradients, sharded over dp) or 3
    #                          (parameters too); absent when nothing is sharded (DDP)
    extra: Mapping[str, Any] = field(default_factory=dict)
    json_name: ClassVar[str] = "degrees"
    _required: ClassVar[tuple[str, ...]] = ("dp", "tp", "pp")
    # plans written before fsdp, sp, cp and ep were recorded lack them: each is then 1

    @classmethod
    def parse(cls, data: Any, source: str) -> Degrees:
        if isinstance(data, Mapping) and not isinstance(data, cls):
            data = {"fsdp": 1, "sp": 1, "cp": 1, "ep": 1, **data}
        return super().parse(data, source)

    def check(self, source: str) -> None:
        for f in fields(self):
            if f.name != "extra" and (f.default is MISSING or getattr(self, f.name) is not None):
                _positive_int(source, f"degrees.{f.name}", getattr(self, f.name))
        if self.zero is not None and self.zero > 3:
            raise PlanFormatError(f"{source}: degrees.zero is a ZeRO stage 1-3, got {self.zero}")


@dataclass(frozen=True, eq=False, kw_only=True)
class Pipeline(_Section):
    """How the step is cut into stages and microbatches."""

    stages: list[list[int]]  # layer ranges [first, last + 1): p of them, or p v chunks when interleaved
    schedule: str  # none (one stage) or one of SCHEDULES
    virtual_stages: int | None = None  # model chunks per device (interleaved)
    microbatches: int
    microbatch_size: int  # samples per microbatch per data-parallel rank
    leading_layers: int | None = None  # first layers, which do not repeat, that the first range holds before its
    # share of the repeating ones (priced as the code before the layers, never recomputed); absent: none
    extra: Mapping[str, Any] = field(default_factory=dict)
    json_name: ClassVar[str] = "pipeline"
    _required: ClassVar[tuple[str, ...]] = ("stages", "schedule", "microbatches", "microbatch_size")

    def check(self, source: str) -> None:
        _positive_int(source, "pipeline.microbatches", self.microbatches)
        _positive_int(source, "pipeline.microbatch_size", self.microbatch_size)
        if self.virtual_stages is not None:
            _positive_int(source, "pipeline.virtual_stages", self.virtual_stages)
        if self.leading_layers is not None:
            _positive_int(source, "pipeline.leading_layers", self.leading_layers)
        if not isinstance(self.schedule, str):
            raise PlanFormatError(f"{source}: pipeline.schedule must be a string, got {_short(self.schedule)}")
        if not isinstance(self.stages, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(i, int) for i in r) for r in self.stages):
            raise PlanFormatError(f"{source}: pipeline.stages must list [first, end) layer ranges")


DTYPES = ("fp32", "bf16", "fp16")
"""Floating-point formats a plan computes, keeps master weights and reduces gradients in."""
FP8_RECIPES = ("tensorwise",)
"""How a plan's float8 linears scale their operands (``precision.fp8``, ``autopar/ir/float8.py``): tensorwise,
one scale per tensor from its absolute maximum, taken at every use (torchao's "tensorwise" recipe, NVIDIA
Transformer Engine's current scaling)."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Precision(_Section):
    """Which dtype the program computes in, the optimizer's parameters are kept in, and gradients are
    reduced in (``passes/mixed_precision.py`` runs it, ``planning/pricing.py`` prices it).

    ``compute`` narrower than ``master`` is mixed precision (Micikevicius et al., ICLR 2018): the
    optimizer steps fp32 master weights, the program reads copies in ``compute``. ``master`` bf16 (with
    ``compute`` bf16: masters narrower than the compute dtype, or of another 16-bit format, are refused)
    keeps the optimizer's parameters and state in bf16 and the program reads the masters themselves
    (Apex ``DistributedFusedAdam(dtype=torch.bfloat16)``, NeMo's ``optim.dtype: bf16``). ``reduce`` is the
    dtype of the gradient reductions outside the program (data parallelism's all_reduce, ZeRO-1/2's
    reduce_scatter, a tied weight's sum across stages); FSDP's reduce_scatter is the backward of its
    gather inside the program and runs in ``compute``. Plans written before this section existed read
    as ``compute`` = ``model.dtype``, fp32 masters and fp32 reductions. ``fp8`` (absent: none) runs the
    linear layers of the repeated layers as float8 matmuls scaled as it names (``FP8_RECIPES``;
    ``autopar/ir/float8.py`` says which, ``passes/float8.py`` runs them); everything else computes in
    ``compute``."""

    compute: str
    master: str
    reduce: str
    fp8: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    json_name: ClassVar[str] = "precision"
    _required: ClassVar[tuple[str, ...]] = ("compute", "master", "reduce")

    def check(self, source: str) -> None:
        for key in self._required:
            if getattr(self, key) not in DTYPES:
                raise PlanFormatError(f"{source}: precision.{key} must be one of {', '.join(DTYPES)}, "
                                      f"got {getattr(self, key)!r}")
        refusal = master_refusal(self.master, self.compute)
        if refusal:
            raise PlanFormatError(f"{source}: precision: {refusal}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise PlanFormatError(f"{source}: precision.fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")

    @property
    def mixed(self) -> bool:
        """Whether the program computes in another dtype than the optimizer's parameters."""
        return self.compute != self.master

    @classmethod
    def of(cls, compute: str, reduce: str | None = None, master: str | None = None,
           fp8: str | None = None) -> Precision:
        """The precision of a plan computing in ``compute``: masters in ``master`` and reductions in
        ``reduce`` (each free: fp32), float8 linears scaled as ``fp8`` names (None: none)."""
        return cls(compute=compute, master=master or "fp32", reduce=reduce or "fp32", fp8=fp8)


def master_refusal(master: str, compute: str) -> str | None:
    """Why master weights in ``master`` cannot serve a program computing in ``compute`` (None if they can):
    the masters are the precision the optimizer keeps, so fp32 serves every compute dtype and a 16-bit
    format only itself (the program then reads the masters: no copy)."""
    if master == "fp32" or master == compute:
        return None
    return (f"master weights in {master} serve only a program computing in {master}, got compute dtype {compute}: "
            "masters narrower than the computation (or of another 16-bit format) would round away what each "
            "step computes; fp32 masters serve any compute dtype")


_SECTIONS: dict[str, type[_Section]] = {"mesh": Mesh, "degrees": Degrees, "pipeline": Pipeline,
                                        "precision": Precision}


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # name, params, layers, flops_per_step, graph_fingerprint
    cluster: dict[str, Any]  # spec, devices, nodes, devices_per_node, device
    mesh: Mesh
    degrees: Degrees
    pipeline: Pipeline
    checkpointing: str  # one of CHECKPOINTING for every layer, or MIXED
    placements: dict[str, list[str]]  # parameter fqn -> placement per mesh dim
    ops: dict[str, dict[str, Any]]  # node -> {"op", "inputs": [[...]], "outputs": [[...]|None], "local"?}
    predicted: dict[str, Any]
    solver: dict[str, Any]
    inputs: dict[str, Any] = field(default_factory=dict)  # placeholder -> {"placements", "shape", "dtype"}
    buffers: dict[str, list[str]] = field(default_factory=dict)  # buffer fqn -> placement per mesh dim
    candidates: list[dict[str, Any]] = field(default_factory=list)  # runners-up of the mesh search
    explanations: dict[str, Any] = field(default_factory=dict)  # alternatives per decision (autopar explain)
    recomputed_layers: dict[str, str] = field(default_factory=dict)  # MIXED: layer -> a mode but none (others: none)
    precision: Precision | None = None  # absent from plans older than mixed precision: derived from model.dtype
    cp_layout: str = CONTIGUOUS  # one of CP_LAYOUTS; absent from plans older than load balancing: contiguous
    cp_attention: str = ALLGATHER  # one of CP_ATTENTIONS; absent from plans older than ring attention: allgather
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        """Sections given as JSON objects (``from_dict``, plan assembly) become their typed values."""
        if self.precision is None:
            dtype = self.model_dtype if isinstance(self.model, Mapping) else "fp32"
            object.__setattr__(self, "precision", Precision.of(str(dtype)))
        for name, kind in _SECTIONS.items():
            object.__setattr__(self, name, kind.parse(getattr(self, name), "plan"))

    @property
    def model_dtype(self) -> str:
        """The dtype the model was planned in (``model.dtype``): fp32 in plans that do not say."""
        return self.model.get("dtype", "fp32")

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as its JSON object (sections in their JSON form, key for key)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: (v.to_json() if k in _SECTIONS else copy.deepcopy(v)) for k, v in data.items()}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write the plan JSON to ``path`` atomically (``core/files.py``)."""
        write_atomically(path, self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "plan") -> "Plan":
        if not isinstance(data, Mapping):
            raise PlanFormatError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise PlanFormatError(f"{source}: schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise PlanFormatError(f"{source}: missing keys {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        plan = cls(**{k: (_SECTIONS[k].parse(v, source) if k in _SECTIONS else v)
                      for k, v in data.items() if k in known})
        plan.validate(source)
        return plan

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        text = read_text(path, "plan", PlanFormatError)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, source=str(path))

    def validate(self, source: str = "plan") -> None:
        """Checks a reader can rely on: section types, the mesh against degrees, every placement."""
        for name, kind in _SECTION_TYPES.items():
            if not isinstance(getattr(self, name), kind):
                raise PlanFormatError(f"{source}: '{name}' must be a JSON {_JSON_NAMES[kind]}, "
                                      f"got {type(getattr(self, name)).__name__}")
        shape = self._checked_mesh(source)
        for key in _PREDICTED_KEYS:
            if not isinstance(self.predicted.get(key), (int, float, dict)):
                raise PlanFormatError(f"{source}: predicted.{key} is missing")
        for fqn, pls in self.placements.items():
            _check_placements(source, f"placement of {fqn!r}", pls, len(shape))
        for fqn, pls in self.buffers.items():
            _check_placements(source, f"placement of buffer {fqn!r}", pls, len(shape))
        for name, spec in _CONTENTS.items():
            _check_value(source, name, getattr(self, name), spec)
        for node, op in self.ops.items():
            for i, pls in enumerate([*op["inputs"], *op["outputs"]]):
                if pls is not None:
                    _check_placements(source, f"ops[{node!r}] placement {i}", pls, len(shape))
            for i, term in enumerate(op.get("collectives", [])):
                _check_collective(source, f"ops[{node!r}].collectives[{i}]", term, len(shape))
        for name, spec in self.inputs.items():
            _check_placements(source, f"placement of input {name!r}", spec["placements"], len(shape))
        self._check_checkpointing(source)
        if self.cp_layout not in CP_LAYOUTS:
            raise PlanFormatError(f"{source}: cp_layout must be one of {', '.join(CP_LAYOUTS)}, got {self.cp_layout!r}")
        if self.cp_attention not in CP_ATTENTIONS:
            raise PlanFormatError(f"{source}: cp_attention must be one of {', '.join(CP_ATTENTIONS)}, "
                                  f"got {self.cp_attention!r}")

    def _check_checkpointing(self, source: str) -> None:
        if self.checkpointing not in (*CHECKPOINTING, MIXED):
            raise PlanFormatError(f"{source}: checkpointing must be one of {', '.join((*CHECKPOINTING, MIXED))}, "
                                  f"got {self.checkpointing!r}")
        if (self.checkpointing == MIXED) != bool(self.recomputed_layers):
            raise PlanFormatError(f"{source}: recomputed_layers lists each recomputed layer's mode when, and only "
                                  f"when, checkpointing is {MIXED!r}")
        bad = {layer: mode for layer, mode in self.recomputed_layers.items() if mode not in CHECKPOINTING[1:]}
        if bad:
            raise PlanFormatError(f"{source}: recomputed_layers: modes must be one of {', '.join(CHECKPOINTING[1:])}, "
                                  f"got {bad}")

    def checkpointing_of(self, layer: str) -> str:
        """The checkpointing mode repeated layer ``layer`` (``blocks.3``) runs in."""
        if self.checkpointing == MIXED:
            return self.recomputed_layers.get(layer, "none")
        return self.checkpointing

    def _checked_mesh(self, source: str) -> list[int]:
        pp = self.degrees.pp
        if self.mesh.devices * pp != self.cluster.get("devices", self.mesh.devices * pp):
            raise PlanFormatError(f"{source}: mesh {self.mesh.shape} x pp={pp} does not cover "
                                  f"{self.cluster.get('devices')} devices")
        return self.mesh.shape

    # ---- views (rendered by autopar.inspect, which registers them: core imports no layer above it) ----
    def summary(self) -> str:
        """The plan as a table (``autopar show``)."""
        return _VIEWS["summary"](self)

    def explain(self, name: str) -> str:
        """Why the op or parameter ``name`` got its strategy: its alternatives and what each would cost."""
        return _VIEWS["explain"](self, name)

    def __str__(self) -> str:  # printing a plan shows the table, not a wall of dicts
        return self.summary()


_VIEWS: dict[str, Callable[..., str]] = {}


def register_view(name: str, view: Callable[..., str]) -> None:
    """Install the renderer behind ``Plan.<name>()`` (``summary``, ``explain``). ``autopar.inspect``
    registers them when it is imported, which ``import autopar`` does."""
    _VIEWS[name] = view


_SECTION_TYPES: dict[str, type] = {
    "model": dict, "cluster": dict, "checkpointing": str,
    "placements": dict, "ops": dict, "predicted": dict, "solver": dict, "inputs": dict, "buffers": dict,
    "candidates": list, "explanations": dict, "recomputed_layers": dict, "cp_layout": str,
    "cp_attention": str,
}
_JSON_NAMES = {dict: "object", str: "string", list: "array"}
_PREDICTED_KEYS = ("step_time_s", "tokens_per_s", "mfu", "compute_s", "comm_s", "exposed_comm_s", "bubble_s",
                   "peak_memory_bytes", "memory_bytes")


def _check_placements(source: str, what: str, pls: Any, ndim: int) -> None:
    if not isinstance(pls, list) or len(pls) != ndim:
        raise PlanFormatError(f"{source}: {what} must list one entry per mesh dim ({ndim})")
    for p in pls:
        try:
            str_to_placement(p) if isinstance(p, str) else str_to_placement(repr(p))
        except PlanFormatError as exc:
            raise PlanFormatError(f"{source}: {what}: {exc}") from None


def _check_collective(source: str, where: str, term: Mapping[str, Any], ndim: int) -> None:
    if not all(0 <= d < ndim for d in [term["mesh_dim"], *term["sharded_on"]]) or len(term["group"]) != 3:
        raise PlanFormatError(f"{source}: {where}: mesh_dim and sharded_on must index the {ndim} mesh dims and "
                              "group list [ranks, ranks per node, nodes]")


# ---- what the readers of a plan (show, explain, report, export, the runtime) rely on in its sections --------
@dataclass(frozen=True)
class _Record:
    """A JSON object with these keys (each value to its spec) and possibly these optional ones; others pass."""

    required: Mapping[str, Any]
    optional: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _ListOf:
    item: Any


@dataclass(frozen=True)
class _MapOf:
    value: Any


@dataclass(frozen=True)
class _OrNull:
    spec: Any


@dataclass(frozen=True)
class _OneOf:
    values: tuple[str, ...]


_NUMBER, _INTEGER, _TEXT, _FLAG, _ANY_OBJECT, _ANY_LIST = "number", "integer", "string", "boolean", "object", "array"
_POSITIVE = "positive number"  # a number that divides: a step time, a bandwidth
_COUNT = "positive integer"  # devices, nodes
_LARGEST = 2**63  # a number a plan holds fits a float and an int64
_PLACEMENTS = _ListOf(_TEXT)  # checked against the mesh by ``_check_placements``
_SECONDS_BY_KIND = _MapOf(_NUMBER)
_COLLECTIVE = _Record(
    {"kind": _TEXT, "phase": _TEXT, "tensor": _TEXT, "mesh_dim": _INTEGER, "nbytes": _NUMBER, "seconds": _NUMBER,
     "why": _TEXT, "shape": _ListOf(_INTEGER), "element_bytes": _POSITIVE, "sharded_on": _ListOf(_INTEGER),
     "group": _ListOf(_COUNT), "grad_sync": _FLAG, "per_microbatch": _FLAG, "share": _POSITIVE},
    {"prefetched": _FLAG})
"""One collective of an op (``planning/explanations.py`` writes every key, ``prefetched`` where it is): ``mesh_dim``
and ``sharded_on`` index the mesh (``Plan.validate``), ``group`` is [ranks, ranks per node, nodes]."""
_OP = _Record(
    {"op": _TEXT, "module": _TEXT, "inputs": _ListOf(_PLACEMENTS), "outputs": _ListOf(_OrNull(_PLACEMENTS))},
    {"decision": _TEXT, "collectives": _ListOf(_COLLECTIVE), "count": _NUMBER, "local": _FLAG,
     "cost": _Record({}, {"compute_s": _NUMBER, "comm_s": _SECONDS_BY_KIND, "grad_sync_s": _NUMBER,
                          "prefetched_s": _NUMBER, "memory_bytes": _NUMBER})})
_ALTERNATIVE = _Record({"strategy": _TEXT, "chosen": _FLAG, "delta_s": _NUMBER, "delta_memory_bytes": _NUMBER},
                       {"compute_s": _NUMBER, "comm_s": _SECONDS_BY_KIND})
_MOE = _Record({"experts": _INTEGER, "top_k": _INTEGER, "group_tokens": _INTEGER, "slots_per_expert": _INTEGER,
                "dropped_tokens": _TEXT, "assumption": _TEXT},
               {"capacity_factor": _OrNull(_NUMBER), "dispatch": _TEXT, "router_imbalance_held": _NUMBER,
                "modules": _ListOf(_TEXT)})
"""``model.moe``: a mixture-of-experts model's routing and capacity, its dropped-token policy, and the router
imbalance its all_to_alls and expert matmuls are priced under (``models/moe.Routing``)."""
_MODEL_FACTS = {"dims": _ANY_OBJECT, "moe": _MOE}
"""What ``model`` states about the model besides its graph, read from its code (config sizes, routing); a
saved problem keeps them for the plans made from it (``check_model_facts``)."""
_CONTENTS: dict[str, Any] = {
    "model": _Record({"name": _TEXT, "params": _INTEGER},
                     {"layers": _INTEGER, "flops_per_step": _NUMBER, "graph_fingerprint": _TEXT,
                      "dtype": _OneOf(DTYPES), **_MODEL_FACTS}),
    "cluster": _Record({"spec": _TEXT, "devices": _COUNT, "intra_bw": _POSITIVE, "inter_bw": _POSITIVE,
                        "device_spec": _Record({"intra_latency_s": _NUMBER, "inter_latency_s": _NUMBER,
                                                "base_latency_s": _NUMBER})},
                       {"nodes": _COUNT, "devices_per_node": _COUNT, "device": _TEXT, "hbm_bytes": _NUMBER}),
    "ops": _MapOf(_OP),
    "predicted": _Record({key: _NUMBER for key in _PREDICTED_KEYS if key not in ("comm_s", "memory_bytes")}
                         | {"step_time_s": _POSITIVE, "comm_s": _SECONDS_BY_KIND, "memory_bytes": _MapOf(_NUMBER)},
                         {"grad_sync_s": _NUMBER, "memory_capacity_bytes": _NUMBER, "optimizer_s": _NUMBER,
                          "runtime": _OneOf(RUNTIMES), "memory_stage": _OneOf(MEMORY_STAGES),
                          "stage_peak_memory_bytes": _MapOf(_NUMBER)}),
    "solver": _Record({"status": _TEXT, "gap": _NUMBER, "wall_s": _NUMBER, "variables": _INTEGER,
                       "constraints": _INTEGER},
                      {"objective": _NUMBER, "bound": _NUMBER, "search_wall_s": _NUMBER, "nodes": _INTEGER,
                       "limit_hit": _FLAG, "phases_s": _MapOf(_NUMBER), "decisions": _INTEGER,
                       "meshes_tried": _INTEGER, "pruned_meshes": _ListOf(_MapOf(_INTEGER))}),
    "inputs": _MapOf(_Record({"placements": _ANY_LIST, "shape": _ListOf(_INTEGER), "dtype": _TEXT})),
    "candidates": _ListOf(_Record({"mesh": _Record({"shape": _ListOf(_INTEGER), "dim_names": _ListOf(_TEXT)}),
                                   "step_time_s": _NUMBER, "status": _TEXT},
                                  {"degrees": _MapOf(_INTEGER), "microbatches": _INTEGER, "schedule": _TEXT,
                                   "checkpointing": _TEXT, "layer_modes": _MapOf(_INTEGER)})),
    "explanations": _Record({}, {"decisions": _MapOf(_Record({"nodes": _ListOf(_TEXT), "alternatives": _ListOf(_ALTERNATIVE)},
                                                             {"occurrences": _NUMBER})),
                                 "index": _MapOf(_TEXT)}),
}


def check_model_facts(source: str, facts: Any) -> None:
    """Raise ``PlanFormatError`` naming the first place in ``facts`` (``dims``, ``moe``) that a plan's
    ``model`` section would refuse."""
    _check_value(source, "model.facts", facts, _Record({}, _MODEL_FACTS))


def _check_value(source: str, where: str, value: Any, spec: Any) -> None:
    """Raise ``PlanFormatError`` naming the first place (``ops['mm'].cost.compute_s``) in ``value`` that does not
    hold what ``spec`` says: numbers are finite and below 2**63, integers are not booleans."""
    if isinstance(spec, _OrNull):
        if value is None:
            return
        spec = spec.spec
    if not _holds(value, spec):
        raise PlanFormatError(f"{source}: {where}: expected {_described(spec)}, got {_short(value)}")
    if isinstance(spec, _ListOf):
        for i, item in enumerate(value):
            _check_value(source, f"{where}[{i}]", item, spec.item)
    elif isinstance(spec, _MapOf):
        for key, item in value.items():
            _check_value(source, f"{where}[{key!r}]", item, spec.value)
    elif isinstance(spec, _Record):
        missing = [key for key in spec.required if key not in value]
        if missing:
            raise PlanFormatError(f"{source}: {where}: missing {', '.join(missing)}")
        for key, item_spec in (*spec.required.items(), *spec.optional.items()):
            if key in value:
                _check_value(source, f"{where}.{key}", value[key], item_spec)


def _holds(value: Any, spec: Any) -> bool:
    if spec == _POSITIVE:
        return _holds(value, _NUMBER) and value > 0
    if spec == _COUNT:
        return _holds(value, _INTEGER) and value > 0
    if spec == _NUMBER:
        return (isinstance(value, int) and not isinstance(value, bool) and abs(value) < _LARGEST) or \
            (isinstance(value, float) and math.isfinite(value) and abs(value) < _LARGEST)
    if spec == _INTEGER:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < _LARGEST
    if isinstance(spec, _ListOf) or spec == _ANY_LIST:
        return isinstance(value, list)
    if isinstance(spec, (_MapOf, _Record)) or spec == _ANY_OBJECT:
        return isinstance(value, dict)
    if isinstance(spec, _OneOf):
        return value in spec.values
    return isinstance(value, {_TEXT: str, _FLAG: bool}[spec])


def _described(spec: Any) -> str:
    if isinstance(spec, _ListOf) or spec == _ANY_LIST:
        return "an array"
    if isinstance(spec, (_MapOf, _Record)) or spec == _ANY_OBJECT:
        return "an object"
    if isinstance(spec, _OneOf):
        return "one of " + ", ".join(spec.values)
    return {_NUMBER: "a finite number", _POSITIVE: "a finite positive number", _COUNT: "a positive integer",
            _INTEGER: "an integer"}.get(spec, f"a {spec}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
