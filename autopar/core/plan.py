"""``Plan``: the frozen, versioned, JSON-serializable contract between the solver and the rewrite passes.

A plan says, for one model on one cluster, the device mesh, the parallel degrees, where every parameter
and input lives (``S(d)``/``R`` per mesh dim), which strategy every graph node runs, and what the cost
model predicts. It is data only: ``passes`` read it to build the per-rank program, ``show``/``compare``
read it to explain it, and nothing in it needs torch to load. Schema ``autopar.plan/1`` (docs/architecture.md "Plan JSON").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from autopar.core.errors import PlanFormatError
from autopar.core.placement import str_to_placement

SCHEMA = "autopar.plan/1"
CHECKPOINTING = ("none", "selective", "full")
"""Activation checkpointing modes of a repeated layer (priced in ``stages.py``, run by ``passes/checkpoint.py``)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules a plan may name (priced in ``cost_models/pipeline.py``, run by ``runtime/pipeline.py``)."""
MIXED = "mixed"
"""``checkpointing`` of a plan whose layers run in different modes, listed in ``recomputed_layers``."""
_REQUIRED = ("schema", "model", "cluster", "mesh", "degrees", "pipeline", "checkpointing", "placements",
             "ops", "predicted", "solver")


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # name, params, layers, flops_per_step, graph_fingerprint
    cluster: dict[str, Any]  # spec, devices, nodes, devices_per_node, device
    mesh: dict[str, Any]  # shape, dim_names
    degrees: dict[str, int]  # parallel degrees, one meaning per key (keys, not mesh axes: core/axes.py):
    #   dp: the data-parallel ranks of a stage, each on its own share of the batch (HSDP: dp_replicate x fsdp)
    #   fsdp: the size of the group parameters are sharded over (mesh dim "dp"); 1 when they are replicated.
    #         Not the ZeRO stage that constraint fsdp pins: that is "zero"
    #   dp_replicate: HSDP's replica groups (mesh dim "dp_replicate"); 1 without HSDP
    #   zero: the ZeRO stage, 1 or 2 (optimizer state, and gradients, sharded over dp) or 3 (parameters too);
    #         absent when nothing is sharded (DDP)
    #   tp: tensor-parallel ranks (mesh dim "tp")
    #   sp: tp when the norms run split on the sequence over tp (sequence parallelism), else 1
    #   cp, ep: context and expert parallelism, 1 (not planned yet)
    #   pp: pipeline stages (the runtime's outermost mesh dim "pp"; ``mesh`` is one stage's)
    pipeline: dict[str, Any]  # stages, schedule, microbatches, microbatch_size
    checkpointing: str  # one of CHECKPOINTING for every layer, or MIXED
    placements: dict[str, list[str]]  # parameter fqn -> placement per mesh dim
    ops: dict[str, dict[str, Any]]  # node -> {"op", "inputs": [[...]], "outputs": [[...]|None], "local"?}
    predicted: dict[str, Any]
    solver: dict[str, Any]
    inputs: dict[str, Any] = field(default_factory=dict)  # placeholder -> {"placements", "shape", "dtype"}
    buffers: dict[str, list[str]] = field(default_factory=dict)  # buffer fqn -> placement per mesh dim
    candidates: list[dict[str, Any]] = field(default_factory=list)  # runners-up of the mesh search
    explanations: dict[str, Any] = field(default_factory=dict)  # alternatives per decision (autopar explain)
    recomputed_layers: dict[str, str] = field(default_factory=dict)  # MIXED: layer -> selective|full (others: none)
    schema: str = SCHEMA

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

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
        plan = cls(**{k: v for k, v in data.items() if k in known})
        plan.validate(source)
        return plan

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanFormatError(f"{path}: no such plan file") from None
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
        self._check_checkpointing(source)

    def _check_checkpointing(self, source: str) -> None:
        if self.checkpointing not in (*CHECKPOINTING, MIXED):
            raise PlanFormatError(f"{source}: checkpointing must be one of {', '.join((*CHECKPOINTING, MIXED))}, "
                                  f"got {self.checkpointing!r}")
        if (self.checkpointing == MIXED) != bool(self.recomputed_layers):
            raise PlanFormatError(f"{source}: recomputed_layers lists each recomputed layer's mode when, and only "
                                  f"when, checkpointing is {MIXED!r}")
        bad = {layer: mode for layer, mode in self.recomputed_layers.items() if mode not in CHECKPOINTING[1:]}
        if bad:
            raise PlanFormatError(f"{source}: recomputed_layers: modes must be selective or full, got {bad}")

    def checkpointing_of(self, layer: str) -> str:
        """The checkpointing mode repeated layer ``layer`` (``blocks.3``) runs in."""
        if self.checkpointing == MIXED:
            return self.recomputed_layers.get(layer, "none")
        return self.checkpointing

    def _checked_mesh(self, source: str) -> list[int]:
        shape, names = self.mesh.get("shape"), self.mesh.get("dim_names")
        if not isinstance(shape, list) or not isinstance(names, list) or len(shape) != len(names) \
                or not all(isinstance(s, int) and s > 0 for s in shape):
            raise PlanFormatError(f"{source}: mesh needs 'shape' (positive ints) and 'dim_names' lists of equal length")
        degrees = dict(self.degrees)
        if not all(isinstance(v, int) and v > 0 for v in degrees.values()) or degrees.get("zero", 1) > 3:
            raise PlanFormatError(f"{source}: degrees must be positive integers (zero: a ZeRO stage 1-3), "
                                  f"got {degrees}")
        devices = 1
        for s in shape:
            devices *= s
        pp = degrees.get("pp", 1)
        if devices * pp != self.cluster.get("devices", devices * pp):
            raise PlanFormatError(f"{source}: mesh {shape} x pp={pp} does not cover {self.cluster.get('devices')} devices")
        return shape

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
    "model": dict, "cluster": dict, "mesh": dict, "degrees": dict, "pipeline": dict, "checkpointing": str,
    "placements": dict, "ops": dict, "predicted": dict, "solver": dict, "inputs": dict, "buffers": dict,
    "candidates": list, "explanations": dict, "recomputed_layers": dict,
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
