"""Constraints: what a user pins (``{"dp": 2, "tp": 2}``, ``--fix``), checked before anything slow runs."""

from __future__ import annotations

from typing import Any, Mapping

from autopar.core.errors import BadInputError
from autopar.core.plan import CHECKPOINTING, SCHEDULES

KNOWN_CONSTRAINTS = {"dp", "tp", "pp", "sp", "fsdp", "dp_shard", "cp", "ep", "microbatches", "microbatch_size",
                     "schedule", "virtual_stages", "checkpointing", "memory_gb", "time_limit_s", "dtype"}


def validate_constraints(constraints: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(constraints) - KNOWN_CONSTRAINTS
    if unknown:
        raise BadInputError(f"unknown constraint(s) {', '.join(sorted(unknown))}: "
                            f"known are {', '.join(sorted(KNOWN_CONSTRAINTS))}")
    out = dict(constraints)
    for key in ("cp", "ep"):
        if int(out.get(key, 1)) != 1:
            raise BadInputError(f"constraint {key}={out[key]}: this version plans {key}=1 only "
                                "(context and expert parallelism are not implemented yet)")
    if "fsdp" in out:
        if str(out["fsdp"]) not in ("0", "1", "2", "3"):
            raise BadInputError(f"constraint fsdp={out['fsdp']!r}: expected a ZeRO stage, 0 (replicated "
                                "parameters, DDP), 1 (sharded optimizer state), 2 (and gradients) or 3 "
                                "(and parameters: FSDP)")
        out["fsdp"] = int(out["fsdp"])
    if "sp" in out:
        out["sp"] = _switch("sp", out["sp"])
    for key in ("dp", "tp", "pp", "dp_shard", "microbatches", "microbatch_size", "virtual_stages"):
        if key in out:
            out[key] = _positive(key, out[key], int)
    if out.get("sp") == 1 and out.get("tp") == 1:
        raise BadInputError("constraint sp=1 splits the norms on the sequence over the tp mesh dim: it needs "
                            "tp > 1, got tp=1")
    if "dp_shard" in out and out.get("fsdp", 3) != 3:
        raise BadInputError(f"constraint dp_shard={out['dp_shard']} (HSDP) shards parameters: it needs fsdp=3, "
                            f"got fsdp={out['fsdp']}")
    if "microbatches" in out and "microbatch_size" in out:
        raise BadInputError("constraints microbatches and microbatch_size: pin one of them (the global batch "
                            "fixes the other)")
    for key in ("memory_gb", "time_limit_s"):
        if key in out:
            out[key] = _positive(key, out[key], float)
    if out.get("dtype") not in (None, "fp32", "bf16", "fp16"):
        raise BadInputError(f"constraint dtype={out['dtype']!r}: expected fp32, bf16 or fp16")
    _check_choice(out, "checkpointing", CHECKPOINTING)
    _check_choice(out, "schedule", SCHEDULES)
    if out.get("schedule") == "interleaved" and out.get("virtual_stages", 2) < 2:
        raise BadInputError("constraint virtual_stages must be at least 2 with schedule=interleaved")
    if "virtual_stages" in out and out["virtual_stages"] > 1 and out.get("schedule", "interleaved") != "interleaved":
        raise BadInputError(f"constraint virtual_stages={out['virtual_stages']} needs schedule=interleaved")
    if "virtual_stages" in out and out["virtual_stages"] > 1:
        out["schedule"] = "interleaved"
    return out


_SWITCH = {"0": 0, "1": 1, "false": 0, "true": 1}


def _switch(key: str, value: Any) -> int:
    """An on/off constraint (``sp``) as 0 or 1, from 0, 1, true or false (any case, or a Python bool)."""
    on = _SWITCH.get(str(value).strip().lower())
    if on is None:
        raise BadInputError(f"constraint {key}={value!r}: expected 0 or 1 (or false/true)")
    return on


def _check_choice(out: dict[str, Any], key: str, allowed: tuple[str, ...]) -> None:
    if key in out:
        value = str(out[key]).lower()
        if value not in allowed:
            raise BadInputError(f"constraint {key}={out[key]!r}: expected one of {', '.join(allowed)}")
        out[key] = value


def _positive(key: str, value: Any, kind: type) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or (kind is int and str(value).strip() != str(number)):
        raise BadInputError(f"constraint {key}={value!r}: expected a positive {'integer' if kind is int else 'number'}")
    return number
