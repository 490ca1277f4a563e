"""``Plan``: the frozen, versioned, JSON-serializable contract between the solver and the rewrite passes.

A plan says, for one model on one cluster, the device mesh, the parallel degrees, where every parameter
and input lives (``S(d)``/``R`` per mesh dim), which strategy every graph node runs, and what the cost
model predicts. It is data only: ``passes`` read it to build the per-rank program, ``show``/``compare``
read it to explain it, and nothing in it needs torch to load. Schema ``autopar.plan/1`` (design.md §5).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .errors import PlanFormatError

SCHEMA = "autopar.plan/1"
_REQUIRED = ("schema", "model", "cluster", "mesh", "degrees", "pipeline", "checkpointing", "placements",
             "ops", "predicted", "solver")


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # name, params, layers, flops_per_step, graph_fingerprint
    cluster: dict[str, Any]  # spec, devices, nodes, devices_per_node, device
    mesh: dict[str, Any]  # shape, dim_names
    degrees: dict[str, int]  # dp, fsdp, tp, sp, cp, ep, pp
    pipeline: dict[str, Any]  # stages, schedule, microbatches, microbatch_size
    checkpointing: str
    placements: dict[str, list[str]]  # parameter fqn -> placement per mesh dim
    inputs: dict[str, Any]  # placeholder -> {"placements": [...], "shape": [...], "dtype": str}
    buffers: dict[str, list[str]]  # buffer fqn -> placement per mesh dim
    ops: dict[str, dict[str, Any]]  # node -> {"op", "inputs": [[...]], "outputs": [[...]|None]}
    predicted: dict[str, Any]
    solver: dict[str, Any]
    candidates: list[dict[str, Any]] = field(default_factory=list)  # runners-up of the mesh search
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
        """Checks a reader can rely on: mesh consistent with degrees and placements."""
        shape = self.mesh.get("shape")
        names = self.mesh.get("dim_names")
        if not isinstance(shape, list) or not isinstance(names, list) or len(shape) != len(names):
            raise PlanFormatError(f"{source}: mesh needs 'shape' and 'dim_names' lists of equal length")
        devices = 1
        for s in shape:
            devices *= int(s)
        if devices * self.degrees.get("pp", 1) != self.cluster.get("devices", devices):
            raise PlanFormatError(f"{source}: mesh {shape} x pp {self.degrees.get('pp', 1)} does not cover "
                                  f"{self.cluster.get('devices')} devices")
        for fqn, pls in self.placements.items():
            if not isinstance(pls, list) or len(pls) != len(shape):
                raise PlanFormatError(f"{source}: placement of {fqn!r} must list one entry per mesh dim")

    # ---- views --------------------------------------------------------------------------------
    def summary(self) -> str:
        from .report import summarize

        return summarize(self)

    def __str__(self) -> str:  # printing a plan shows the table, not a wall of dicts
        return self.summary()
