"""Constraints: what a user pins (``{"dp": 2, "tp": 2}``, ``--fix dp=2,tp=2``), checked before anything slow runs.

``Constraints`` is the one value the planner reads them from: a field is ``None`` where the planner is
free. It is built from the API's ``constraints=`` mapping (``Constraints.from_mapping``) or the CLI's
``--fix`` text (``Constraints.parse``) and checks itself on construction, as torchtitan's ``ParallelDims``
checks its degrees, so a refused value is named (with what was expected) before the model is built or
captured. Checks that need the cluster or the model (a degree that does not divide the world, a pipeline
deeper than the model) stay with the planner.

The keys are the field names but one: users write the ZeRO stage (field ``zero_stage``) as ``fsdp``
(``--fix fsdp=0``). The plan's ``degrees["fsdp"]`` is another number: the size of the group the parameters
are sharded over (``core/plan.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import Any, Callable, Mapping

from autopar.core.errors import BadInputError
from autopar.core.plan import (CHECKPOINTING, CP_ATTENTIONS, DTYPES, FP8_RECIPES, LOWERED, MULTI_CHUNK_SCHEDULES,
                               RING, RUNTIMES, SCHEDULES, master_refusal)

ZERO_STAGES = (0, 1, 2, 3)
MASTER_DTYPES = ("fp32", "bf16")
"""Dtypes of master weights a user may pin: fp16 masters would need loss scaling, which autopar does not do."""
_ZERO_STAGES_IN_WORDS = ("0 (replicated parameters, DDP), 1 (sharded optimizer state), 2 (and gradients) "
                         "or 3 (and parameters: FSDP)")
_SWITCH = {"0": 0, "1": 1, "false": 0, "true": 1}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_POSITIVE_INT = re.compile(r"[1-9][0-9]*")


def split_pairs(text: str | None, what: str) -> dict[str, str]:
    """``"dp=2, tp=4,schedule=1F1B"`` -> ``{"dp": "2", "tp": "4", "schedule": "1F1B"}``: the ``key=value,...``
    text of ``--fix`` and ``--set`` (``what`` names the flag in errors). Empty or None text gives ``{}``; a
    malformed or repeated item is refused, naming it."""
    pairs: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not _KEY.fullmatch(key) or not value:
            raise BadInputError(f"bad {what} item {item!r}: expected key=value")
        if key in pairs:
            raise BadInputError(f"bad {what} item {item!r}: {key!r} given twice")
        pairs[key] = value
    return pairs


# ---- one value at a time: each returns the value as the field holds it, or names what it expected ----------

def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str) and _POSITIVE_INT.fullmatch(value.strip()):
        return int(value)
    raise BadInputError(f"constraint {key} must be a positive integer, got {value!r}")


def _positive_number(key: str, value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise BadInputError(f"constraint {key} must be a positive number, got {value!r}")
    return number


def _switch(key: str, value: Any) -> int:
    """An on/off constraint (``sp``) as 0 or 1, from 0, 1, true or false (any case, or a Python bool)."""
    on = _SWITCH.get(str(value).strip().lower())
    if on is None:
        raise BadInputError(f"constraint {key} must be 0 or 1 (or false/true), got {value!r}")
    return on


def _zero_stage(key: str, value: Any) -> int:
    if isinstance(value, bool) or str(value).strip() not in {str(stage) for stage in ZERO_STAGES}:
        raise BadInputError(f"constraint {key} must be a ZeRO stage: {_ZERO_STAGES_IN_WORDS}; got {value!r}")
    return int(value)


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if not isinstance(value, str) or value.strip().lower() not in allowed:
            raise BadInputError(f"constraint {key} must be one of {', '.join(allowed)}, got {value!r}")
        return value.strip().lower()

    return check


def _pinned(check: Callable[[str, Any], Any], key: str | None = None) -> Any:
    """A field, ``None`` (free) unless pinned; ``check`` turns a pinned value into the field's type.
    ``key`` is the name users write, where it is not the field's."""
    return field(default=None, metadata={"check": check, "key": key})


@dataclass(frozen=True)
class Constraints:
    """Degrees and options a user pins; every field ``None`` leaves the planner free to choose it."""

    dp: int | None = _pinned(_positive_int)
    """Data-parallel degree: the ranks that each work on their own share of the batch (under HSDP,
    replica groups x shard group)."""
    tp: int | None = _pinned(_positive_int)
    """Tensor-parallel degree. Free, it stays inside a node; pinned, it may span nodes."""
    pp: int | None = _pinned(_positive_int)
    """Pipeline stages."""
    sp: int | None = _pinned(_switch)
    """Sequence parallelism over tp: 1 splits the norms and the residual stream on the sequence, 0 keeps
    the norms whole (``true``/``false`` are accepted). 1 needs tp > 1."""
    zero_stage: int | None = _pinned(_zero_stage, key="fsdp")
    """Key ``fsdp``: the ZeRO stage of data parallelism, 0 (DDP: parameters replicated), 1 (optimizer state
    sharded), 2 (and gradients) or 3 (and parameters: FSDP)."""
    dp_shard: int | None = _pinned(_positive_int)
    """HSDP: the size of the groups parameters are sharded over (``dp / dp_shard`` replica groups). Needs
    ``fsdp`` 3 or free."""
    cp: int | None = _pinned(_positive_int)
    """Context-parallel degree: the ranks each sequence is split over (on its sequence dim; fused attention
    gathers the keys and values). Free, it is searched where activation memory shapes the plan; it needs
    a model with fused attention and 2 x cp dividing the sequence (two chunks per rank, for even causal
    work). It composes with ``ep`` (a mixture-of-experts model's routing groups within a rank's chunks of
    ``seq / 2 cp`` tokens) and HSDP (parameters sharded over ``dp x cp``, replicated across replica groups)."""
    cp_attention: str | None = _pinned(_one_of(CP_ATTENTIONS))
    """How fused attention runs over the sequence split on cp: allgather (the keys and values gathered
    before it, Llama 3's) or ring (passed around the cp ranks inside it, each exchange behind one block's
    compute); free, the planner prices both and picks. Needs cp > 1 where cp is pinned."""
    ep: int | None = _pinned(_positive_int)
    """Expert-parallel degree: the ranks of a data-parallel group over which expert weights are split
    (dividing ``dp`` and the number of experts); 1 keeps every expert on every rank."""
    microbatches: int | None = _pinned(_positive_int)
    """Microbatches per step (gradient accumulation, or the pipeline's microbatches)."""
    microbatch_size: int | None = _pinned(_positive_int)
    """Sequences per microbatch on each data-parallel rank; pin this or ``microbatches``, not both."""
    schedule: str | None = _pinned(_one_of(SCHEDULES))
    """Pipeline schedule: gpipe, 1f1b, interleaved or zero_bubble (any case); free, the planner prices
    1f1b, interleaved and zero_bubble and picks. It shapes the pipeline meshes of the search (pp free: the
    planner may still find a plan without a pipeline better); refused with pp=1, as ``virtual_stages`` > 1 is."""
    virtual_stages: int | None = _pinned(_positive_int)
    """Model chunks per pipeline stage; more than 1 means ``schedule=interleaved`` (whose default is 2)
    unless ``schedule=zero_bubble`` is pinned (whose default is 1)."""
    checkpointing: str | None = _pinned(_one_of(CHECKPOINTING))
    """Activation checkpointing of every repeated layer: none, core_attention (Megatron-LM's selective:
    the attention core recomputed), selective (PyTorch's: all but linear layers and fused attention
    recomputed), save_dot_except_mlpwi (MaxText's: selective, and the MLP's input projections
    recomputed too) or full (free: searched per layer)."""
    memory_gb: float | None = _pinned(_positive_number)
    """Memory per device the plan may use, in GB of 1e9 bytes (free: the device's usable memory)."""
    solver_nodes: int | None = _pinned(_positive_int)
    """Branch-and-bound nodes the ILP solver may explore on each problem (free: ``solver.NODE_LIMIT``).
    A limit on work, not time: the plan is the same on any machine (there is no time limit)."""
    dtype: str | None = _pinned(_one_of(DTYPES))
    """Compute dtype: fp32, bf16 or fp16 (free: fp32 on cpu, bf16 elsewhere). Narrower than the model's
    fp32 parameters, it is mixed precision: the optimizer keeps fp32 master weights and the program
    computes with copies in this dtype (``passes/mixed_precision.py``)."""
    reduce_dtype: str | None = _pinned(_one_of(DTYPES))
    """Dtype of the gradient reductions outside the program (data parallelism's all_reduce, ZeRO-1/2's
    reduce_scatter, a tied weight's sum across stages): free, fp32 (Megatron-LM's and torchtitan's
    default under bf16); bf16 or fp16 halves their bytes at the cost of summing in that precision."""
    master_dtype: str | None = _pinned(_one_of(MASTER_DTYPES))
    """Dtype of the master weights, the parameters the optimizer steps and keeps its state like (AdamW's
    moments): free, fp32 (the planner never narrows them: it would change the numerics); bf16 keeps
    parameters, gradients and optimizer state in bf16 (Apex ``DistributedFusedAdam(dtype=torch.bfloat16)``,
    NeMo's ``optim.dtype: bf16``): under AdamW and DDP 8 bytes per parameter instead of 18 (12 with fp32
    gradient reductions, whose bucket holds a widened copy), under ZeRO-1 2 + 2 + 6/dp. bf16 masters need
    bf16 compute (the program reads them): ``dtype`` free becomes bf16, ``dtype`` fp32 or fp16 is refused."""
    fp8: str | None = _pinned(_one_of(FP8_RECIPES))
    """Float8 linear layers: tensorwise runs each linear layer of the repeated layers (both weight dims
    multiples of 16) as a float8 matmul, its operands scaled by their absolute maximum at every use: e4m3
    forward, the output's gradient in e5m2 (torchao's "tensorwise" float8 training, Transformer Engine's
    current scaling). The maximum is the whole tensor's however the plan splits it (an all_reduce of one
    number where it is split), so a plan trains as one process would. Free: none (the planner never
    changes the numerics); needs a device with FP8 tensor cores (H100, H200, B200)."""
    runtime: str | None = _pinned(_one_of(RUNTIMES))
    """The runtime the plan will run on, which the price assumes (``predicted.runtime``): dtensor
    (``autoparallelize(..., lowered=False)``, collectives where each op needs them) or lowered
    (``autoparallelize``'s default: an FSDP layer's gradient reduce_scatter is launched as soon as
    its gradients exist and its backward regather a layer ahead, both hiding behind backward's compute,
    priced like data parallelism's bucketed all_reduce; the forward's gathers stay on the critical path).
    Free: each mesh priced for the runtime ``autoparallelize`` runs its plans on by default
    (``planning/roles.priced_runtime``): lowered on one stage, DTensor on pipeline meshes and where a cp dim
    may choose ring attention. Pinned lowered: one-stage meshes only (pp free: pipeline meshes are priced on
    DTensor; pp > 1 refused), keys and values gathered under context parallelism (``cp_attention``
    allgather; ring refused)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:  # frozen: the checked value replaces the given one (e.g. "2" -> 2)
                object.__setattr__(self, f.name, f.metadata["check"](_key(f), value))
        self._refuse_contradictions()
        if self.virtual_stages is not None and self.virtual_stages > 1 and self.schedule is None:
            object.__setattr__(self, "schedule", "interleaved")
        if self.master_dtype not in (None, "fp32") and self.dtype is None:
            object.__setattr__(self, "dtype", self.master_dtype)

    # ---- boundaries ------------------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, constraints: Mapping[str, Any]) -> Constraints:
        """From the API's ``constraints=`` (``{"dp": 2, "fsdp": 0, "schedule": "1F1B"}``); values may be
        text, as ``--fix`` gives them."""
        unknown = {str(key) for key in constraints} - set(KEYS)
        if "time_limit_s" in unknown:
            raise BadInputError("constraint time_limit_s is gone: a time limit made plans depend on the machine's "
                                "load; solver_nodes=N bounds the solver's work instead")
        if unknown:
            raise BadInputError(f"unknown constraint(s) {', '.join(sorted(unknown))}: "
                                f"known are {', '.join(sorted(KEYS))}")
        return cls(**{KEYS[key]: value for key, value in constraints.items()})

    @classmethod
    def parse(cls, text: str | None) -> Constraints:
        """From ``--fix`` text: ``"dp=2,tp=4,schedule=1F1B"``."""
        return cls.from_mapping(split_pairs(text, "--fix"))

    def to_dict(self) -> dict[str, Any]:
        """The pinned constraints under the keys users write (``fsdp``), as ``from_mapping`` takes them."""
        return {_key(f): getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    # ---- what the planner reads beyond the fields ---------------------------------------------------------
    @property
    def pipeline_schedule(self) -> str:
        """The schedule of a pipeline: the pinned one, else 1f1b."""
        return self.schedule or "1f1b"

    @property
    def model_chunks(self) -> int:
        """Model chunks per pipeline stage: ``virtual_stages``, else 2 under interleaved, else 1."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule == "interleaved" else 1

    # ---- checks across fields -------------------------------------------------------------------------------
    def _refuse_contradictions(self) -> None:
        refusal = master_refusal(self.master_dtype, self.dtype) if self.master_dtype and self.dtype else None
        if refusal:
            raise BadInputError(f"constraints master_dtype={self.master_dtype} and dtype={self.dtype}: {refusal}")
        if self.sp == 1 and self.tp == 1:
            raise BadInputError("constraint sp=1 splits the norms on the sequence over the tp mesh dim: it needs "
                                "tp > 1, got tp=1")
        if self.cp_attention is not None and self.cp == 1:
            raise BadInputError(f"constraint cp_attention={self.cp_attention} chooses how attention runs over a "
                                "sequence split on cp: it needs cp > 1, got cp=1")
        if self.runtime == LOWERED and (self.pp not in (None, 1) or self.cp_attention == RING):
            raise BadInputError(f"constraint runtime=lowered: a lowered program has one stage and gathers keys and "
                                f"values for context parallelism; got pp={self.pp}, cp_attention={self.cp_attention}")
        if self.dp_shard is not None and self.zero_stage not in (None, 3):
            raise BadInputError(f"constraint dp_shard={self.dp_shard} (HSDP) shards parameters: it needs fsdp=3, "
                                f"got fsdp={self.zero_stage}")
        if self.ep not in (None, 1) and self.dp_shard is not None:
            raise BadInputError(f"constraints ep={self.ep} and dp_shard={self.dp_shard}: HSDP is not combined with "
                                "expert parallelism; pin one of them")
        if self.microbatches is not None and self.microbatch_size is not None:
            raise BadInputError("constraints microbatches and microbatch_size: pin one of them (the global batch "
                                "fixes the other)")
        if self.pp == 1 and (self.schedule is not None or (self.virtual_stages or 1) > 1):
            pinned = f"schedule={self.schedule}" if self.schedule is not None else \
                f"virtual_stages={self.virtual_stages}"
            raise BadInputError(f"constraint {pinned} shapes a pipeline: it needs pp > 1 or pp free, got pp=1")
        if self.schedule == "interleaved" and self.model_chunks < 2:
            raise BadInputError("constraint virtual_stages must be at least 2 with schedule=interleaved")
        if self.virtual_stages is not None and self.virtual_stages > 1 \
                and self.schedule not in (None, *MULTI_CHUNK_SCHEDULES):
            raise BadInputError(f"constraint virtual_stages={self.virtual_stages} needs schedule="
                                f"{' or '.join(MULTI_CHUNK_SCHEDULES)}")


def _key(f: Any) -> str:
    """The name users write for field ``f``."""
    return f.metadata["key"] or f.name


KEYS = {_key(f): f.name for f in fields(Constraints)}
"""The keys of ``from_mapping`` and ``--fix``, in field order, and the field each sets."""
