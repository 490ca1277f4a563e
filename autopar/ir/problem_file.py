"""Save and load a planning problem: the captured training step, so that what-if questions skip capture.

Capture (``torch.export`` + decomposition) is the slow part of planning: 11 to 25 s for Llama 3 8B/70B,
against seconds to re-price or re-solve. A saved problem is what the planner reads of a capture, as
versioned JSON (schema ``autopar.problem/1``; no pickle, so loading one runs no code):

* every graph node: name, op, target (an aten overload such as ``aten.mm.default``, resolved back
  through ``torch.ops``; or ``operator.getitem``), arguments with node references and constants, the
  module path it came from (``nn_module_stack``, read by ``capture.module_path``), and its value's
  shape, stride and dtype (rebuilt as meta-device tensors, tuples of them for multi-output ops);
* what each placeholder stands for (parameters, buffers, lifted constants, user inputs), the loss node,
  the tie keys of repeated layers, the leading layers that do not repeat and the frozen parameters
  (``requires_grad=False``), where there are any;
* the model name, a description of the inputs (names, shapes, dtypes), and what a plan states about the
  model that its graph does not show, read from the model's code when it was captured (``facts``: named
  sizes, ``dims``; a mixture-of-experts model's routing, ``moe``), so a plan made from the file states
  them too.

A loaded problem plans, re-solves and re-prices exactly like the capture it came from; it cannot run
(no weights, no Python module): training re-captures the real model.
"""

from __future__ import annotations

import json
import keyword
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from autopar.ir.capture import CapturedGraph, LayerStack
from autopar.ir.layers import layer_names
from autopar.core.errors import BadInputError, PlanFormatError
from autopar.core.plan import check_model_facts
from autopar.core.files import read_text, write_atomically

SCHEMA = "autopar.problem/1"
_PYTHON_TARGETS = {"operator": operator, "math": math}  # the only non-aten callables a target may name
_TORCH_ENUMS = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}
_SIZE_BITS = 48  # a tensor dim or stride in a problem file is below 2**48 (a product of a few stays in int64)
_LEAST_TRACED = 3  # layers of a stack traced: the first, the last, and those sharing the rest (LayerStack.weight)


@dataclass(frozen=True)
class SavedProblem:
    """A captured training step read back from a problem file, with the model's name."""

    captured: CapturedGraph
    model_name: str
    inputs: list[dict[str, Any]]  # per user input: name, shape, dtype (a description for readers)
    facts: dict[str, Any] = field(default_factory=dict)  # the plan's model facts (``dims``, ``moe``), as saved


class _Malformed(Exception):
    """What is wrong with a problem file (the loader adds the file name)."""


# ---- saving ---------------------------------------------------------------------------------------

def save_problem(captured: CapturedGraph, path: str | Path, *, model_name: str,
                 facts: dict[str, Any] | None = None) -> None:
    """Write ``captured`` as ``autopar.problem/1`` JSON to ``path`` atomically (``core/files.py``), with
    the model's ``facts`` (``SavedProblem.facts``)."""
    write_atomically(path, json.dumps(problem_to_dict(captured, model_name, facts), separators=(",", ":")))


def problem_to_dict(captured: CapturedGraph, model_name: str, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "torch_version": torch.__version__,
        "model": {"name": model_name, "inputs": describe_inputs(captured), **({"facts": facts} if facts else {})},
        "nodes": [_node_to_dict(node) for node in captured.graph.nodes],
        "params": captured.params,
        "buffers": captured.buffers,
        "constants": {name: _encode_val(t) for name, t in captured.constants.items()},
        "user_inputs": captured.user_inputs,
        "loss_node": captured.loss_node,
        "tie_keys": captured.tie_keys,
        **({"frozen": sorted(captured.frozen)} if captured.frozen else {}),
        **({"leading_layers": list(captured.leading_layers)} if captured.leading_layers else {}),
        **({"stack": {"path": captured.stack.path, "layers": captured.stack.layers, "traced": captured.stack.traced}}
           if captured.stack is not None else {}),
    }


def describe_inputs(captured: CapturedGraph) -> list[dict[str, Any]]:
    out = []
    for name in captured.user_inputs:
        val = captured.node(name).meta["val"]
        out.append({"name": name, "shape": list(val.shape), "dtype": _dtype_name(val.dtype)})
    return out


def _node_to_dict(node: fx.Node) -> dict[str, Any]:
    try:
        record = {"name": node.name, "op": node.op, "target": _target_name(node),
                  "args": _encode(node.args), "kwargs": {k: _encode(v) for k, v in node.kwargs.items()}}
        if "val" in node.meta:
            record["val"] = _encode_val(node.meta["val"])
    except _Malformed as exc:
        raise BadInputError(f"cannot save node {node.name!r} ({node.target}): {exc}") from None
    stack = node.meta.get("nn_module_stack")
    if stack:
        record["module_stack"] = [[key, path, str(kind)] for key, (path, kind) in stack.items()]
    return record


def _target_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return str(node.target)
    if node.op != "call_function":
        raise _Malformed(f"{node.op} nodes are not part of a captured training step")
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.mm.default"
    for module_name, module in _PYTHON_TARGETS.items():
        if getattr(module, getattr(target, "__name__", ""), None) is target:
            return f"{module_name}.{target.__name__}"
    raise _Malformed(f"target {target!r} is neither an aten overload nor an operator function")


def _encode(value: Any) -> Any:
    """An argument as JSON: node references and non-JSON constants become one-key objects."""
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, slice):
        return {"slice": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if value is Ellipsis:
        return {"ellipsis": None}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, cls in _TORCH_ENUMS.items():
        if isinstance(value, cls):
            return {kind: str(value).replace("torch.", "")}
    raise _Malformed(f"argument {value!r} of type {type(value).__name__} has no problem-file form")


def _encode_val(val: Any) -> Any:
    """A node's value: a tensor's shape/stride/dtype, a tuple of values, a Python scalar or null."""
    if isinstance(val, torch.Tensor):
        return {"tensor": {"shape": list(val.shape), "stride": list(val.stride()), "dtype": _dtype_name(val.dtype)}}
    if isinstance(val, (list, tuple)):
        return {type(val).__name__: [_encode_val(v) for v in val]}
    if val is None or isinstance(val, (bool, int, float)):
        return val
    raise _Malformed(f"value of type {type(val).__name__} has no problem-file form")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- loading --------------------------------------------------------------------------------------

def load_problem(path: str | Path) -> SavedProblem:
    """Read a problem file; a missing, malformed or wrong-schema file raises BadInputError naming it."""
    text = read_text(path, "problem")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        return problem_from_dict(data)
    except _Malformed as exc:
        raise BadInputError(f"{path}: {exc}") from None


def problem_from_dict(data: Any) -> SavedProblem:
    if not isinstance(data, dict):
        raise _Malformed(f"expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise _Malformed(f"schema is {data.get('schema')!r}, expected {SCHEMA!r} (save one with "
                         "`autopar plan MODEL ... --save-problem FILE`)")
    missing = [k for k in ("model", "nodes", "params", "buffers", "constants", "user_inputs", "loss_node",
                           "tie_keys") if k not in data]
    if missing:
        raise _Malformed(f"missing keys {', '.join(missing)}")
    graph = _graph_from_records(_typed(data, "nodes", list))
    captured = CapturedGraph(
        graph_module=fx.GraphModule(torch.nn.Module(), graph),
        params=_names_to_names(data, "params"),
        buffers=_names_to_names(data, "buffers"),
        constants={name: _decode_val(v, f"constant {name!r}") for name, v in _typed(data, "constants", dict).items()},
        user_inputs=[str(n) for n in _typed(data, "user_inputs", list)],
        loss_node=str(data["loss_node"]),
        tie_keys=_names_to_names(data, "tie_keys"),
        stack=_stack(data.get("stack")),
        frozen=_frozen(data.get("frozen", []), data["params"]),
    )
    _check_references(captured)
    if captured.stack is not None:
        _check_stack(captured)
    captured.leading_layers = _leading_layers(data.get("leading_layers", []), captured)
    _check_values(captured.graph)
    model = _typed(data, "model", dict)
    inputs = model.get("inputs", [])
    if not isinstance(inputs, list):
        raise _Malformed(f"'model.inputs' must be a JSON array, got {type(inputs).__name__}")
    facts = model.get("facts", {})
    try:
        check_model_facts("the facts saved with the model", facts)
    except PlanFormatError as exc:
        raise _Malformed(str(exc)) from None
    return SavedProblem(captured, str(model.get("name", "model")), inputs, facts)


def _frozen(data: Any, params: dict[str, str]) -> frozenset[str]:
    """The frozen parameters' placeholders (``CapturedGraph.frozen``): a list of names of ``params``."""
    if not isinstance(data, list) or not all(isinstance(n, str) and n in params for n in data):
        raise _Malformed(f"'frozen' must list parameter placeholders of 'params', got {data!r}")
    return frozenset(data)


def _stack(data: Any) -> LayerStack | None:
    """The traced stack of identical layers (``capture.LayerStack``), when the problem has one."""
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("path"), str) \
            or not all(isinstance(data.get(k), int) and not isinstance(data.get(k), bool) for k in ("layers", "traced")):
        raise _Malformed(f"'stack' must be {{\"path\": str, \"layers\": int, \"traced\": int}}, got {data!r}")
    stack = LayerStack(data["path"], data["layers"], data["traced"])
    if not _LEAST_TRACED <= stack.traced < stack.layers < 2**_SIZE_BITS:
        raise _Malformed(f"'stack' traces {stack.traced} of {stack.layers} layers: a stack traces at least "
                         f"{_LEAST_TRACED} of its layers, and fewer than all")
    return stack


def _check_stack(captured: CapturedGraph) -> None:
    """Every node inside the stack lies in one of its traced layers."""
    for node in captured.graph.nodes:
        index = captured.traced_layer(node.name)
        if index is not None and index >= captured.stack.traced:
            raise _Malformed(f"node {node.name!r} lies in layer {index} of '{captured.stack.path}', which "
                             f"traces {captured.stack.traced}")


def _typed(data: dict, key: str, kind: type) -> Any:
    value = data[key]
    if not isinstance(value, kind):
        raise _Malformed(f"'{key}' must be a JSON {'array' if kind is list else 'object'}, got {type(value).__name__}")
    return value


def _leading_layers(names: Any, captured: CapturedGraph) -> tuple[str, ...]:
    """The saved leading layers (``CapturedGraph.leading_layers``), checked to be the graph's first layers."""
    layers = layer_names(captured)
    if not isinstance(names, list) or names != layers[:len(names)]:
        raise _Malformed(f"'leading_layers' must list the graph's first layers in order ({layers[:2]}...), "
                         f"got {json.dumps(names)[:80]}")
    return tuple(names)


def _names_to_names(data: dict, key: str) -> dict[str, str]:
    table = _typed(data, key, dict)
    if not all(isinstance(v, str) for v in table.values()):
        raise _Malformed(f"'{key}' must map names to strings")
    return dict(table)


def _graph_from_records(records: list) -> fx.Graph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for i, record in enumerate(records):
        where = f"node {i}" + (f" {record.get('name')!r}" if isinstance(record, dict) else "")
        try:
            node = _node_from_record(graph, record, env)
        except _Malformed as exc:
            raise _Malformed(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise _Malformed(f"{where}: {type(exc).__name__}: {exc}") from None
        env[node.name] = node
    ops = [n.op for n in graph.nodes]
    if ops.count("output") != 1 or ops[-1] != "output":
        raise _Malformed("the graph must end in its one output node")
    return graph


def _node_from_record(graph: fx.Graph, record: dict, env: dict[str, fx.Node]) -> fx.Node:
    if not isinstance(record, dict):
        raise _Malformed(f"expected an object, got {type(record).__name__}")
    name, op = record["name"], record["op"]
    if op not in ("placeholder", "call_function", "output"):
        raise _Malformed(f"op {op!r} is not placeholder, call_function or output")
    target = _resolve_target(record["target"]) if op == "call_function" else _identifier(record["target"], "target")
    args = _decode(record.get("args", {"tuple": []}), env)
    kwargs = {_identifier(k, "keyword"): _decode(v, env) for k, v in record.get("kwargs", {}).items()}
    if not isinstance(args, (tuple, list)):
        raise _Malformed(f"args must be a list, got {type(args).__name__}")
    if op == "placeholder" and (args or kwargs):
        raise _Malformed(f"placeholder {name!r} takes no arguments")  # fx would write them as defaults
    if op == "output" and (len(args) != 1 or kwargs):
        raise _Malformed(f"the output node takes one argument (what the step returns), got {len(args)}")
    node = graph.create_node(op, target, tuple(args), kwargs, name=name)
    if node.name != name:
        raise _Malformed(f"duplicate or invalid node name {name!r}")
    if "val" in record:
        node.meta["val"] = _decode_val(record["val"], "value")
    if record.get("module_stack"):
        node.meta["nn_module_stack"] = _module_stack(record["module_stack"])
    return node


def _module_stack(entries: Any) -> dict[str, tuple[str, str]]:
    """``nn_module_stack`` from its ``[[key, module path, module class], ...]`` form."""
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(part, str) for part in e) for e in entries):
        raise _Malformed(f"module_stack must list [key, module path, module class] strings, got {entries!r}")
    return {key: (path, kind) for key, path, kind in entries}


def _identifier(name: Any, what: str) -> str:
    """A placeholder's target or a keyword argument's name: torch.fx writes them into the Python source
    of the graph it compiles, so anything but a plain identifier (``x=print(...)``) would run as code."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise _Malformed(f"{what} {name!r} is not a Python identifier")
    return name


def _resolve_target(name: Any) -> Any:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``; ``operator.getitem`` -> ``operator.getitem``."""
    parts = str(name).split(".")
    if len(parts) == 2 and parts[0] in _PYTHON_TARGETS:
        target = getattr(_PYTHON_TARGETS[parts[0]], parts[1], None)
        if callable(target):
            return target
    if len(parts) == 3:
        try:
            target = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError):
            target = None
        if isinstance(target, torch._ops.OpOverload):
            return target
    raise _Malformed(f"unknown target {name!r} (an op of a library this process has not loaded, "
                     f"or a torch other than the one that saved the problem?)")


def _decode(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise _Malformed(f"argument {value!r} is not a one-key tagged value")
    (tag, body), = value.items()
    if tag == "node":
        if body not in env:
            raise _Malformed(f"refers to {body!r}, which is not an earlier node")
        return env[body]
    if tag == "tuple":
        return tuple(_decode(v, env) for v in body)
    if tag == "float":
        return float(body)
    if tag == "slice":
        return slice(*(_decode(v, env) for v in body))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "device":
        return torch.device(body)
    if tag in _TORCH_ENUMS:
        return _torch_enum(tag, body)
    raise _Malformed(f"unknown argument tag {tag!r}")


def _torch_enum(kind: str, name: str) -> Any:
    value = getattr(torch, str(name), None)
    if not isinstance(value, _TORCH_ENUMS[kind]):
        raise _Malformed(f"{name!r} is not a torch {kind}")
    return value


def _decode_val(value: Any, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise _Malformed(f"{what} {value!r} is not a tensor, tuple, list or scalar")
    (tag, body), = value.items()
    if tag in ("tuple", "list") and isinstance(body, list):
        items = [_decode_val(v, what) for v in body]
        return tuple(items) if tag == "tuple" else items
    if tag != "tensor" or not isinstance(body, dict):
        raise _Malformed(f"{what}: {tag!r} of {body!r} is not a tensor, tuple or list")
    shape, stride = body.get("shape"), body.get("stride")
    if not _sizes(shape) or not _sizes(stride) or len(shape) != len(stride):
        raise _Malformed(f"{what}: shape {shape!r} and stride {stride!r} do not describe a tensor (lists of "
                         f"as many non-negative integers below 2**{_SIZE_BITS})")
    return torch.empty_strided(shape, stride, dtype=_torch_enum("dtype", body.get("dtype")), device="meta")


def _sizes(value: Any) -> bool:
    """``value`` is a list of sizes or strides a tensor can have."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**_SIZE_BITS for v in value)


def _check_values(graph: fx.Graph) -> None:
    """Every op, run on meta tensors of its arguments' recorded values, gives the value the file records
    (shapes and dtypes): the graph is one torch can run, with the arguments its op schemas take."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        try:
            value = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
            raise _Malformed(f"node {node.name!r}: {node.target} does not run on its arguments "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        if _shapes(value) != _shapes(node.meta.get("val")):
            raise _Malformed(f"node {node.name!r}: {node.target} gives {_shapes(value)}, the file records "
                             f"{_shapes(node.meta.get('val'))}")


def _shapes(value: Any) -> Any:
    """A value's tensors as (shape, dtype), in its tuple and list structure; other values as they are."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return [_shapes(v) for v in value]
    return value


def _check_references(captured: CapturedGraph) -> None:
    """Every name the tables use is a node, and every placeholder and op has a value."""
    names = {n.name for n in captured.graph.nodes}
    for what, table in (("params", captured.params), ("buffers", captured.buffers),
                        ("constants", captured.constants), ("tie_keys", captured.tie_keys)):
        unknown = sorted(set(table) - names)
        if unknown:
            raise _Malformed(f"'{what}' names {unknown[0]!r}, which is not a node of the graph")
    for name in [*captured.user_inputs, captured.loss_node]:
        if name not in names:
            raise _Malformed(f"{name!r} (an input or the loss) is not a node of the graph")
    untied = sorted(names - set(captured.tie_keys))
    if untied:
        raise _Malformed(f"node {untied[0]!r} has no tie key")
    for node in captured.graph.nodes:
        if node.op == "placeholder" and not isinstance(node.meta.get("val"), torch.Tensor):
            raise _Malformed(f"placeholder {node.name!r} has no tensor value (shape, stride and dtype)")
