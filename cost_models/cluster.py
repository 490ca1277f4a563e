"""Cluster topology: the ``NxGxTYPE`` spec (docs/architecture.md "Cluster spec") and where a mesh dimension's ranks live.

This module is for parsing a cluster spec (string or JSON/YAML file) into a validated ``Cluster``
and for answering, per device-mesh dimension, "how many of this group's ranks share a node, and
how many nodes does it span" (``GroupTopology``), which is what the communication formulas in
``comm.py`` need. It prices nothing itself.

Spec grammar::

    NxGxTYPE[,ib=BW][,nvlink=BW][,mem=SIZE]       e.g. 16x8xH100,ib=200Gbps,nvlink=450GBps

* N nodes, G devices per node, TYPE a device preset from ``hardware.py`` (case-insensitive).
* ``ib``: network bandwidth per device; ``nvlink``: ring bandwidth per device inside a node.
  Units: ``Gbps``/``Gb/s`` (bits), ``GBps``/``GB/s`` (bytes), also ``T`` prefixes; a bare
  number is GB/s. Lower-case ``b`` is bits, upper-case ``B`` bytes. The value is taken as the
  achieved bus bandwidth (no derating): ``ib=200Gbps`` is 25e9 bytes/s.
* ``mem``: HBM capacity per device: ``GB`` (10**9), ``GiB`` (2**30), ``TB``, ``TiB``; bare is GB.

A path ending in ``.json`` (or ``.yaml``/``.yml`` when PyYAML is importable) that exists is read
as ``{"nodes": N, "devices_per_node": G, "device": TYPE or {...}, "ib": ..., "nvlink": ...,
"mem": ...}``. ``device`` may be a full DeviceSpec dict, or a partial one with ``"base": TYPE``
naming the preset it modifies. Optional ``source`` (a string) and ``measured`` (a mapping) describe
where the figures come from; ``autopar calibrate`` writes such profiles (``calibrate.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from .hardware import LARGEST_AMOUNT, SMALLEST_RATE, DeviceSpec, get_device

EXPECTED_FORM = "expected NxGxTYPE like 4x8xH100 (optionally ',ib=400Gbps,nvlink=900GBps,mem=80GB')"


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be understood; the message quotes it and shows the expected form."""


# --------------------------------------------------------------------------------------------
# GroupTopology
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupTopology:
    """The ranks of one communication group (one mesh dimension) and the links between them.

    ``per_node`` is the most ranks of the group on any one node and ``nodes`` the number of nodes
    it spans; for layouts aligned to node boundaries (every power-of-two mesh on power-of-two
    nodes) ``size == per_node * nodes``.
    """

    size: int
    per_node: int
    nodes: int
    intra_bw: float
    inter_bw: float
    intra_latency_s: float
    inter_latency_s: float
    base_latency_s: float

    def __post_init__(self) -> None:
        for attr in ("size", "per_node", "nodes"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupTopology.{attr} must be a positive int, got {value!r}")
        if self.per_node > self.size or self.nodes > self.size or self.per_node * self.nodes < self.size:
            raise ValueError(f"inconsistent GroupTopology: size={self.size}, per_node={self.per_node}, "
                             f"nodes={self.nodes}; expected per_node <= size, nodes <= size and "
                             "per_node * nodes >= size")
        for attr in ("intra_bw", "inter_bw"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"GroupTopology.{attr} must be positive, got {getattr(self, attr)!r}")
        for attr in ("intra_latency_s", "inter_latency_s", "base_latency_s"):
            if not getattr(self, attr) >= 0:
                raise ValueError(f"GroupTopology.{attr} must be non-negative, got {getattr(self, attr)!r}")

    @classmethod
    def from_device(cls, device: DeviceSpec, size: int, per_node: int | None = None) -> "GroupTopology":
        """A group of ``size`` ranks on ``device`` presets, ``per_node`` per node (default: one node)."""
        per_node = size if per_node is None else per_node
        return cls(size=size, per_node=per_node, nodes=math.ceil(size / per_node),
                   intra_bw=device.nvlink_bw, inter_bw=device.net_bw,
                   intra_latency_s=device.intra_latency_s, inter_latency_s=device.inter_latency_s,
                   base_latency_s=device.base_latency_s)

    @property
    def is_intra_node(self) -> bool:
        """All ranks share one node."""
        return self.nodes == 1

    @property
    def is_hierarchical(self) -> bool:
        """Spans several nodes with several ranks on each: priced as two levels."""
        return self.nodes > 1 and self.per_node > 1

    def within_node(self) -> "GroupTopology":
        """The sub-group of this group's ranks on one node."""
        return replace(self, size=self.per_node, nodes=1)

    def across_nodes(self) -> "GroupTopology":
        """The sub-group of one rank per node (same local index on every node)."""
        return replace(self, size=self.nodes, per_node=1)


# --------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of one type; bandwidths are effective (after overrides)."""

    spec: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_bw: float
    inter_bw: float

    def __post_init__(self) -> None:
        for attr in ("nodes", "devices_per_node"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterSpecError(f"bad cluster spec {self.spec!r}: {attr} must be a positive int, "
                                       f"got {value!r}")
        for attr in ("intra_bw", "inter_bw"):
            if not getattr(self, attr) > 0:
                raise ClusterSpecError(f"bad cluster spec {self.spec!r}: {attr} must be positive, "
                                       f"got {getattr(self, attr)!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def group(self, mesh_shape: Sequence[int], dim: int) -> GroupTopology:
        """Topology of the group along mesh dimension ``dim``.

        The mesh is laid out row-major over global ranks (rank = node * devices_per_node + local),
        so the group along ``dim`` has stride ``prod(mesh_shape[dim+1:])``. The group containing
        rank 0 is inspected; ``per_node`` is the most of its ranks on one node.
        """
        shape = self._checked_mesh(mesh_shape)
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise ValueError(f"mesh dim {dim!r} out of range for mesh shape {shape}: "
                             f"expected 0..{len(shape) - 1}")
        dim %= len(shape)
        size, stride = shape[dim], math.prod(shape[dim + 1:])
        per_node, nodes = _node_layout(size, stride, self.devices_per_node)
        return GroupTopology(size=size, per_node=per_node, nodes=nodes,
                             intra_bw=self.intra_bw, inter_bw=self.inter_bw,
                             intra_latency_s=self.device.intra_latency_s,
                             inter_latency_s=self.device.inter_latency_s,
                             base_latency_s=self.device.base_latency_s)

    def _checked_mesh(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(mesh_shape)
        if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
            raise ValueError(f"bad mesh shape {shape}: expected a non-empty sequence of positive ints")
        if math.prod(shape) != self.world_size:
            raise ValueError(f"mesh shape {shape} has {math.prod(shape)} devices but cluster {self.spec!r} "
                             f"has {self.world_size}: expected the product of the mesh shape to equal "
                             "the world size")
        return shape

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary; ``device_spec`` holds the full (possibly overridden) device."""
        return {
            "spec": self.spec,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "devices": self.world_size,
            "device": self.device.name,
            "intra_bw": self.intra_bw,
            "inter_bw": self.inter_bw,
            "hbm_bytes": self.device.hbm_bytes,
            "device_spec": self.device.to_dict(),
        }


def _node_layout(size: int, stride: int, devices_per_node: int) -> tuple[int, int]:
    """(most ranks on one node, nodes spanned) for ranks 0, stride, ..., (size-1)*stride."""
    if stride >= devices_per_node:
        return 1, size
    counts = Counter((i * stride) // devices_per_node for i in range(size))
    return max(counts.values()), len(counts)


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

_HEAD = re.compile(r"(\d+)x(\d+)x([a-z0-9][a-z0-9_.\-]*)", re.IGNORECASE)
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
_BANDWIDTH = re.compile(_NUMBER + r"\s*(?:([MGTmgt])([bB])(?:ps|PS|Ps|/s|/S)?)?")
_SIZE = re.compile(_NUMBER + r"\s*([A-Za-z]*)")
_PREFIX = {"m": 1e6, "g": 1e9, "t": 1e12}
_SIZE_UNITS = {"": 10**9, "gb": 10**9, "gib": 2**30, "tb": 10**12, "tib": 2**40}


def parse_bandwidth(text: str) -> float:
    """Bytes/s from '200Gbps', '25GB/s', '450GBps', '0.9TB/s' or a bare number of GB/s."""
    match = _BANDWIDTH.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f"bad bandwidth {text!r}: expected a number with Gbps, Gb/s, GBps or GB/s "
                         "(bare number = GB/s)")
    number, prefix, unit = match.groups()
    scale = _PREFIX[prefix.lower()] if prefix else 1e9
    value = float(number) * scale / (8 if unit == "b" else 1)
    return _positive(text, value)


def parse_size(text: str) -> int:
    """Bytes from '80GB', '80GiB', '1.5TB' or a bare number of GB."""
    match = _SIZE.fullmatch(str(text).strip())
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ValueError(f"bad memory size {text!r}: expected a number with GB, GiB, TB or TiB "
                         "(bare number = GB)")
    return int(_positive(text, float(match.group(1)) * _SIZE_UNITS[unit]))


def _positive(text: str, value: float) -> float:
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bad value {text!r}: expected a positive amount")
    if value < SMALLEST_RATE:
        raise ValueError(f"bad value {text!r}: {value:.3g} is less than one byte (per second)")
    if value > LARGEST_AMOUNT:
        raise ValueError(f"bad value {text!r}: {value:.3g} is more than any device has (at most {LARGEST_AMOUNT:.3g})")
    return value


def _apply_ib(fields: dict[str, Any], value: str) -> None:
    fields["inter_bw"] = parse_bandwidth(value)


def _apply_nvlink(fields: dict[str, Any], value: str) -> None:
    fields["intra_bw"] = parse_bandwidth(value)


def _apply_mem(fields: dict[str, Any], value: str) -> None:
    fields["device"] = replace(fields["device"], hbm_bytes=parse_size(value))


#: Override key -> how it changes the Cluster's fields.
OVERRIDES: Mapping[str, Callable[[dict[str, Any], str], None]] = {
    "ib": _apply_ib,
    "nvlink": _apply_nvlink,
    "mem": _apply_mem,
}


MAX_DEVICES = 2**20
"""The largest cluster a spec may describe: 64 times the largest published training run (16,384 GPUs,
Llama 3 405B), beyond which a spec is a typo, not a cluster."""


def parse_cluster(spec: str) -> Cluster:
    """Parse ``NxGxTYPE[,key=value...]`` or a JSON/YAML file path into a Cluster."""
    if not isinstance(spec, str):
        raise ClusterSpecError(f"bad cluster spec {spec!r}: {EXPECTED_FORM}")
    text = spec.strip()
    if text.lower().endswith((".json", ".yaml", ".yml")):
        if not os.path.isfile(text):
            raise ClusterSpecError(f"bad cluster spec {spec!r}: no such file; give an existing .json/.yaml "
                                   f"file or a spec string ({EXPECTED_FORM})")
        return _cluster_from_file(text)
    head, *overrides = [part.strip() for part in text.split(",")]
    match = _HEAD.fullmatch(head)
    if not match:
        raise ClusterSpecError(f"bad cluster spec {spec!r}: {EXPECTED_FORM}")
    nodes, devices_per_node, type_name = int(match.group(1)), int(match.group(2)), match.group(3)
    pairs = [_split_override(spec, item) for item in overrides]
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ClusterSpecError(f"bad cluster spec {spec!r}: an override key is repeated in {keys}; "
                               "give each once")
    return _build(spec, nodes, devices_per_node, _device_for(spec, type_name), dict(pairs))


def _split_override(spec: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().lower()
    if not sep or not value.strip() or key not in OVERRIDES:
        raise ClusterSpecError(f"bad cluster spec {spec!r}: override {item!r} is not key=value with key in "
                               f"{', '.join(OVERRIDES)}; {EXPECTED_FORM}")
    return key, value.strip()


def _device_for(spec: str, type_name: str) -> DeviceSpec:
    try:
        return get_device(type_name)
    except ValueError as err:
        raise ClusterSpecError(f"bad cluster spec {spec!r}: {err}") from None


def _build(spec: str, nodes: int, devices_per_node: int, device: DeviceSpec,
           overrides: Mapping[str, str]) -> Cluster:
    """Apply overrides to the preset's figures and validate."""
    if nodes < 1 or devices_per_node < 1:
        raise ClusterSpecError(f"bad cluster spec {spec!r}: N and G must be positive ints; {EXPECTED_FORM}")
    if nodes * devices_per_node > MAX_DEVICES:
        raise ClusterSpecError(f"bad cluster spec {spec!r}: {nodes * devices_per_node:,} devices; autopar plans "
                               f"clusters of up to {MAX_DEVICES:,}")
    fields: dict[str, Any] = {"spec": spec, "nodes": nodes, "devices_per_node": devices_per_node,
                              "device": device, "intra_bw": device.nvlink_bw, "inter_bw": device.net_bw}
    for key, value in overrides.items():
        try:
            OVERRIDES[key](fields, value)
        except ValueError as err:
            raise ClusterSpecError(f"bad cluster spec {spec!r}: {key}: {err}") from None
    return Cluster(**fields)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------

_METADATA_KEYS = ("source", "measured")
"""Keys a cluster file may carry for its reader, not the planner: where the numbers come from and, for
a profile written by ``autopar calibrate``, the raw measurements and fits."""
_FILE_KEYS = ("nodes", "devices_per_node", "device", *OVERRIDES, *_METADATA_KEYS)


def _cluster_from_file(path: str) -> Cluster:
    data = _load_mapping(path)
    unknown = sorted(set(data) - set(_FILE_KEYS))
    missing = [k for k in ("nodes", "devices_per_node", "device") if k not in data]
    if unknown or missing:
        raise ClusterSpecError(f"bad cluster file {path!r}: unknown keys {unknown}, missing keys {missing}; "
                               f"expected keys {', '.join(_FILE_KEYS)}")
    nodes, devices_per_node = data["nodes"], data["devices_per_node"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (nodes, devices_per_node)):
        raise ClusterSpecError(f"bad cluster file {path!r}: nodes and devices_per_node must be positive "
                               f"ints, got {nodes!r} and {devices_per_node!r}")
    _check_metadata(path, data)
    overrides = {k: str(data[k]) for k in OVERRIDES if k in data}
    return _build(path, nodes, devices_per_node, _device_from_value(path, data["device"]), overrides)


def _check_metadata(path: str, data: Mapping[str, Any]) -> None:
    if not isinstance(data.get("source", ""), str) or not isinstance(data.get("measured", {}), dict):
        raise ClusterSpecError(f"bad cluster file {path!r}: source must be a string and measured a mapping, "
                               f"got {type(data.get('source')).__name__} and {type(data.get('measured')).__name__}")


def _load_mapping(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle) if path.lower().endswith(".json") else _load_yaml(path, handle)
    except (OSError, ValueError) as err:
        raise ClusterSpecError(f"bad cluster file {path!r}: {err}") from None
    if not isinstance(data, dict):
        raise ClusterSpecError(f"bad cluster file {path!r}: expected a mapping at top level, got "
                               f"{type(data).__name__}")
    return data


def _load_yaml(path: str, handle: Any) -> Any:
    try:
        import yaml  # optional: only for .yaml cluster files
    except ImportError:
        raise ClusterSpecError(f"bad cluster file {path!r}: reading YAML needs PyYAML; "
                               "install it or use a .json file") from None
    try:
        return yaml.safe_load(handle)
    except yaml.YAMLError as err:
        raise ValueError(str(err).replace("\n", " ")) from None


def _device_from_value(path: str, value: Any) -> DeviceSpec:
    """A preset name, a full DeviceSpec dict, or a partial dict with "base": preset name."""
    try:
        if isinstance(value, str):
            return get_device(value)
        if not isinstance(value, dict):
            raise ValueError(f"device must be a name or a dict, got {value!r}")
        if "base" in value:
            base = get_device(value["base"]).to_dict()
            return DeviceSpec.from_dict({**base, **{k: v for k, v in value.items() if k != "base"}})
        return DeviceSpec.from_dict(value)
    except (TypeError, ValueError) as err:
        raise ClusterSpecError(f"bad cluster file {path!r}: {err}") from None
