"""``Constraints``: every key's good and bad values, contradictions between keys, the ``--fix`` parser, the
round trip through ``to_dict``, and the public API refusing a bad constraint before it captures the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar import BadInputError, UnsupportedModelError
from autopar.core.constraints import KEYS, Constraints, split_pairs

GOOD = [  # key, value as given, field, value as held
    ("dp", 2, "dp", 2), ("dp", " 8", "dp", 8), ("tp", "4", "tp", 4), ("pp", 2, "pp", 2),
    ("sp", 1, "sp", 1), ("sp", 0, "sp", 0), ("sp", "true", "sp", 1), ("sp", "False", "sp", 0), ("sp", True, "sp", 1),
    ("fsdp", 0, "zero_stage", 0), ("fsdp", "2", "zero_stage", 2), ("fsdp", 3, "zero_stage", 3),
    ("dp_shard", "4", "dp_shard", 4), ("cp", 1, "cp", 1), ("ep", "4", "ep", 4),
    ("cp_attention", "Ring", "cp_attention", "ring"), ("cp_attention", "allgather", "cp_attention", "allgather"),
    ("microbatches", "4", "microbatches", 4), ("microbatch_size", 1, "microbatch_size", 1),
    ("schedule", "1F1B", "schedule", "1f1b"), ("schedule", "gpipe", "schedule", "gpipe"),
    ("virtual_stages", 1, "virtual_stages", 1), ("virtual_stages", "3", "virtual_stages", 3),
    ("checkpointing", "Full", "checkpointing", "full"), ("checkpointing", "none", "checkpointing", "none"),
    ("memory_gb", "1.5", "memory_gb", 1.5), ("memory_gb", 80, "memory_gb", 80.0),
    ("solver_nodes", "200", "solver_nodes", 200),
    ("dtype", "BF16", "dtype", "bf16"), ("dtype", "fp32", "dtype", "fp32"),
    ("reduce_dtype", "bf16", "reduce_dtype", "bf16"), ("reduce_dtype", "FP32", "reduce_dtype", "fp32"),
    ("master_dtype", "FP32", "master_dtype", "fp32"),  # bf16 pins dtype too: tests/test_optimizer_dtype.py
    ("runtime", "Lowered", "runtime", "lowered"), ("runtime", "dtensor", "runtime", "dtensor"),
    ("fp8", "TensorWise", "fp8", "tensorwise"),
]


def test_every_key_has_good_values_here():
    assert {key for key, *_ in GOOD} == set(KEYS)


@pytest.mark.parametrize("key, given, name, held", GOOD)
def test_good_value_is_held_typed(key, given, name, held):
    pinned = Constraints.from_mapping({key: given})
    assert getattr(pinned, name) == held and type(getattr(pinned, name)) is type(held)
    assert all(getattr(pinned, f.name) is None for f in dataclasses.fields(pinned) if f.name not in (name, "schedule"))


@pytest.mark.parametrize("constraints, message", [
    ({"cp": "abc"}, "constraint cp must be a positive integer, got 'abc'"),
    ({"dp": 0}, "constraint dp must be a positive integer, got 0"),
    ({"tp": -2}, "constraint tp must be a positive integer, got -2"),
    ({"tp": "two"}, "constraint tp must be a positive integer, got 'two'"),
    ({"pp": 2.0}, "constraint pp must be a positive integer, got 2.0"),
    ({"dp_shard": True}, "constraint dp_shard must be a positive integer, got True"),
    ({"microbatches": 0}, "constraint microbatches must be a positive integer, got 0"),
    ({"microbatches": "02"}, "constraint microbatches must be a positive integer, got '02'"),
    ({"microbatch_size": "1.5"}, "constraint microbatch_size must be a positive integer, got '1.5'"),
    ({"virtual_stages": 0}, "constraint virtual_stages must be a positive integer, got 0"),
    ({"ep": "x"}, "constraint ep must be a positive integer, got 'x'"),
    ({"sp": 2}, "constraint sp must be 0 or 1 (or false/true), got 2"),
    ({"sp": "yes"}, "constraint sp must be 0 or 1 (or false/true), got 'yes'"),
    ({"fsdp": 4}, "constraint fsdp must be a ZeRO stage: 0 (replicated parameters, DDP)"),
    ({"fsdp": "three"}, "got 'three'"),
    ({"fsdp": True}, "constraint fsdp must be a ZeRO stage"),
    ({"schedule": "zigzag"}, "constraint schedule must be one of gpipe, 1f1b, interleaved, zero_bubble, got 'zigzag'"),
    ({"checkpointing": "some"}, "constraint checkpointing must be one of none, core_attention, selective, "
                                "save_dot_except_mlpwi, full, got 'some'"),
    ({"dtype": "int8"}, "constraint dtype must be one of fp32, bf16, fp16, got 'int8'"),
    ({"fp8": "delayed"}, "constraint fp8 must be one of tensorwise, got 'delayed'"),
    ({"memory_gb": "lots"}, "constraint memory_gb must be a positive number, got 'lots'"),
    ({"memory_gb": 0}, "constraint memory_gb must be a positive number, got 0"),
    ({"memory_gb": "nan"}, "got 'nan'"),
    ({"solver_nodes": 0}, "constraint solver_nodes must be a positive integer, got 0"),
    ({"cp_attention": "tree"}, "constraint cp_attention must be one of allgather, ring, got 'tree'"),
    ({"cp": 1, "cp_attention": "ring"}, "constraint cp_attention=ring chooses how attention runs over a sequence "
                                        "split on cp: it needs cp > 1, got cp=1"),
    ({"ep": 0}, "constraint ep must be a positive integer, got 0"),
    ({"ep": 2, "dp_shard": 2}, "HSDP is not combined with expert parallelism"),
    ({"bogus": 1, "tensor_parallel": 8}, "unknown constraint(s) bogus, tensor_parallel: known are checkpointing, cp"),
    ({"zero_stage": 1}, "unknown constraint(s) zero_stage"),  # the field's name; users write fsdp
])
def test_bad_value_is_named_with_what_was_expected(constraints, message):
    with pytest.raises(BadInputError) as err:
        Constraints.from_mapping(constraints)
    assert message in str(err.value)


@pytest.mark.parametrize("constraints, message", [
    ({"sp": 1, "tp": 1}, "sp=1 splits the norms on the sequence over the tp mesh dim: it needs tp > 1"),
    ({"dp_shard": 2, "fsdp": 1}, "dp_shard=2 (HSDP) shards parameters: it needs fsdp=3, got fsdp=1"),
    ({"microbatches": 2, "microbatch_size": 1}, "pin one of them"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, "virtual_stages=2 needs schedule=interleaved or zero_bubble"),
    ({"virtual_stages": 1, "schedule": "interleaved"}, "virtual_stages must be at least 2 with schedule=interleaved"),
    ({"pp": 1, "schedule": "1f1b"}, "constraint schedule=1f1b shapes a pipeline: it needs pp > 1 or pp free, got pp=1"),
    ({"pp": 1, "virtual_stages": 3}, "constraint virtual_stages=3 shapes a pipeline"),
    ({"pp": 1, "virtual_stages": 2, "schedule": "zero_bubble"}, "schedule=zero_bubble shapes a pipeline"),
])
def test_contradicting_constraints_are_refused(constraints, message):
    with pytest.raises(BadInputError, match="constraint") as err:
        Constraints.from_mapping(constraints)
    assert message in str(err.value)


def test_combinations_that_agree():
    assert Constraints.from_mapping({"pp": 1, "virtual_stages": 1}).pp == 1
    assert Constraints.from_mapping({"schedule": "zero_bubble"}).pp is None  # pp free: the search may use it
    assert Constraints.from_mapping({"sp": 1, "tp": 2}).sp == 1
    assert Constraints.from_mapping({"dp_shard": 2, "fsdp": 3}).dp_shard == 2
    assert Constraints.from_mapping({"dp_shard": 2}).zero_stage is None


def test_pipeline_schedule_and_chunks():
    assert (Constraints().pipeline_schedule, Constraints().model_chunks) == ("1f1b", 1)
    assert Constraints(schedule="gpipe").pipeline_schedule == "gpipe"
    interleaved = Constraints(schedule="interleaved")
    assert (interleaved.pipeline_schedule, interleaved.model_chunks) == ("interleaved", 2)
    chunked = Constraints(virtual_stages=4)  # more than one chunk per stage is the interleaved schedule
    assert (chunked.schedule, chunked.model_chunks) == ("interleaved", 4)
    assert Constraints(virtual_stages=1).schedule is None


def test_fix_text_is_parsed_into_typed_constraints():
    pinned = Constraints.parse(" dp=2, tp=4,schedule=1F1B,fsdp=0,sp=true,memory_gb=1.5,")
    assert pinned == Constraints(dp=2, tp=4, schedule="1f1b", zero_stage=0, sp=1, memory_gb=1.5)
    assert Constraints.parse(None) == Constraints.parse("") == Constraints.parse(" , ") == Constraints()


@pytest.mark.parametrize("text, message", [
    ("tp", "bad --fix item 'tp': expected key=value"),
    ("=3", "bad --fix item '=3': expected key=value"),
    ("dp=", "bad --fix item 'dp=': expected key=value"),
    ("dp=2,dp=4", "bad --fix item 'dp=4': 'dp' given twice"),
    ("cp=abc", "constraint cp must be a positive integer, got 'abc'"),
    ("dp=2,nope=1", "unknown constraint(s) nope"),
])
def test_bad_fix_text_is_named(text, message):
    with pytest.raises(BadInputError) as err:
        Constraints.parse(text)
    assert message in str(err.value)


def test_split_pairs_keeps_values_as_text_and_names_the_flag():
    assert split_pairs("layers=2, bias=false", "--set") == {"layers": "2", "bias": "false"}
    with pytest.raises(BadInputError, match="bad --set item 'a b=1'"):
        split_pairs("a b=1", "--set")


def test_to_dict_gives_the_keys_users_write_and_round_trips():
    pinned = Constraints.parse("fsdp=2,dp=4,virtual_stages=2,checkpointing=FULL")
    assert pinned.to_dict() == {"dp": 4, "fsdp": 2, "schedule": "interleaved", "virtual_stages": 2,
                                "checkpointing": "full"}
    assert Constraints.from_mapping(pinned.to_dict()) == pinned
    assert Constraints().to_dict() == {}


def test_constraints_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Constraints().dp = 2  # type: ignore[misc]


# ---- the public API checks constraints before it captures ----------------------------------------------

class CannotBeCaptured(nn.Module):
    """A model whose capture fails: reaching it means the constraints were not checked first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the capture ran")


def test_plan_refuses_a_bad_constraint_before_capturing():
    model, inputs = CannotBeCaptured(), (torch.zeros(8, 4),)
    with pytest.raises(UnsupportedModelError, match="the capture ran"):  # the control: this model fails capture
        autopar.plan(model, inputs, "1x4xcpu", constraints={"dp": 4})
    with pytest.raises(BadInputError, match="constraint cp must be a positive integer, got 'abc'"):
        autopar.plan(model, inputs, "1x4xcpu", constraints={"dp": 4, "cp": "abc"})
    with pytest.raises(BadInputError, match=r"constraints must be a mapping such as \{'dp': 2, 'fsdp': 0\} or a "
                                            "Constraints, got list"):
        autopar.plan(model, inputs, "1x4xcpu", constraints=[("dp", 4)])
    with pytest.raises(BadInputError, match="unknown constraint"):
        autopar.plan(model, inputs, "1x4xcpu", constraints={4: "dp"})


def test_autoparallelize_refuses_a_bad_constraint_first():
    """Before asking for a process group (this test has none) and before the capture."""
    model, inputs = CannotBeCaptured(), (torch.zeros(8, 4),)
    with pytest.raises(BadInputError, match="initialized process group"):  # the control
        autopar.autoparallelize(model, inputs, constraints={"dp": 4})
    with pytest.raises(BadInputError, match="constraint fsdp must be a ZeRO stage"):
        autopar.autoparallelize(model, inputs, constraints={"fsdp": 5})


def test_plan_takes_a_constraints_value_too():
    model, inputs = CannotBeCaptured(), (torch.zeros(8, 4),)
    with pytest.raises(UnsupportedModelError, match="the capture ran"):
        autopar.plan(model, inputs, "1x4xcpu", constraints=Constraints(dp=4))
