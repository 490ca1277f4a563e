"""The typed sections of a Plan (``core/plan.py``: ``Mesh``, ``Degrees``, ``Pipeline``): attributes
inside autopar, the same JSON objects outside; malformed sections are refused naming the key.
No capture: sections are built from JSON objects."""

from __future__ import annotations

import json

import pytest

from autopar import PlanFormatError
from autopar.core.plan import Degrees, Mesh, Pipeline

DEGREES = {"dp": 4, "fsdp": 2, "tp": 2, "sp": 2, "cp": 1, "ep": 1, "pp": 2, "dp_replicate": 2, "zero": 3}
PIPELINE = {"stages": [[0, 2], [2, 4]], "schedule": "1f1b", "virtual_stages": 1, "microbatches": 4,
            "microbatch_size": 2}


def test_a_section_reads_as_attributes_and_as_its_json_object():
    degrees = Degrees.parse(DEGREES, "test")
    assert (degrees.dp, degrees.fsdp, degrees.zero, degrees.pp) == (4, 2, 3, 2)
    assert degrees["tp"] == degrees.tp == 2
    assert degrees == DEGREES and list(degrees) == list(DEGREES)
    assert json.dumps(degrees.to_json()) == json.dumps(DEGREES)


def test_an_optional_key_left_out_stays_out():
    ddp = {k: v for k, v in DEGREES.items() if k != "zero"}
    degrees = Degrees.parse(ddp, "test")
    assert degrees.zero is None and "zero" not in degrees and degrees.to_json() == ddp
    with pytest.raises(KeyError):
        degrees["zero"]


def test_keys_this_version_does_not_know_survive_a_round_trip():
    future = {**PIPELINE, "zero_bubble": True}
    pipeline = Pipeline.parse(future, "test")
    assert pipeline.microbatches == 4 and pipeline["zero_bubble"] is True
    assert list(pipeline.to_json()) == list(future)


def test_degrees_written_before_fsdp_sp_cp_ep_were_recorded_read_as_one():
    degrees = Degrees.parse({"dp": 8, "tp": 1, "pp": 1}, "old.json")
    assert (degrees.fsdp, degrees.sp, degrees.cp, degrees.ep) == (1, 1, 1, 1)


def test_mesh_sizes_by_axis_with_dropped_dims_of_one():
    mesh = Mesh.parse({"shape": [2, 4], "dim_names": ["dp", "tp"]}, "test")
    assert (mesh.ndim, mesh.devices, mesh.size("tp"), mesh.size("dp_replicate")) == (2, 8, 4, 1)


@pytest.mark.parametrize("section, data, named", [
    (Degrees, {**DEGREES, "tp": 0}, "degrees.tp"),
    (Degrees, {**DEGREES, "zero": 4}, "degrees.zero"),
    (Degrees, {"dp": 2, "pp": 1}, "tp"),
    (Pipeline, {**PIPELINE, "microbatches": "4"}, "pipeline.microbatches"),
    (Pipeline, {**PIPELINE, "stages": [[0, 2, 4]]}, "pipeline.stages"),
    (Mesh, {"shape": [2, 2], "dim_names": ["dp"]}, "mesh"),
    (Mesh, [2, 2], "mesh"),
])
def test_a_malformed_section_is_refused_naming_the_key(section, data, named):
    with pytest.raises(PlanFormatError, match=named.replace(".", r"\.")) as err:
        section.parse(data, "bad.json")
    assert "bad.json" in str(err.value)
