"""Lowering: a one-stage program run as forward and backward graphs of local tensor ops with explicit
collectives, derived once, instead of dispatching every op through DTensor on every step.

``build_program`` gives a graph whose values are DTensors: each op goes through DTensor's Python
dispatch at run time (sharding propagation, local shapes, redistributes), which costs more host time
than small kernels take. ``LoweredProgram`` traces that program once, at its first call, with AOT
autograd over fake tensors: DTensor inputs are desugared to their local tensors (torch's tensor
subclass support), every redistribute becomes the functional collectives it runs
(``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``wait_tensor``)
and autograd's backward becomes a second graph. From then on a call runs the two fx graphs on plain
tensors; AOT autograd's wrapper unwraps the DTensor arguments and wraps the outputs (the loss; the
parameters' gradients with the placements DTensor's backward gave them), so ZeRO (``zero.py``) and
mixed precision's masters (``mixed_precision.py``) stay outside the graph and run as in the DTensor
runtime. The gradient sync's reductions (``gradient_sync.py``) move into the backward graph when the
runtime hands the sync over (one microbatch; under gradient accumulation they stay outside, once per
step), and ``lower_buckets.py``'s passes rewrite the traced graphs' collectives:

* gradient all_reduces: flat buckets of ``GradientSync``'s size, each launched as soon as its last
  gradient is produced, waited on when the backward graph ends (the sync then only stores them), or
  where the gradients leave the graph as the bucket's views, when the backward pass ends, after they
  are filed and the loss is finished (``defer_bucket_waits``, as DDP waits in autograd's final callback);
* FSDP: each layer's parameter all_gathers (or, outside layers, each module's) become one flat
  all_gather, launched one layer ahead (right after the previous layer's wait) and waited on right
  before its first reader, in the forward and in backward's regathers; each layer's gradient
  reduce_scatters become one, launched after the layer's last gradient, waited on at the end;
* a gathered value only summed whole (the loss's global mean: its per-token losses and its mask of
  counted targets) becomes the all_reduce of the local sum (``reduce_gathered_sums``);
* a collective computed from non-parameter inputs alone (the loss's count of targets) is launched at
  its graph's start;
* an activation gathered again in backward (``rematerialize.py``: sequence parallelism's norm output) is
  launched before the matmul ahead of its readers and waited on where it was (``launch_regathers_ahead``);
* the loss's end, from the wait on its all-reduced sum on, leaves the forward graph
  (``defer_output_waits``): ``start`` returns the loss unfinished and ``finish`` waits and computes it,
  which ``forward`` does at once and ``ParallelModule.step`` after backward (as DDP, whose ranks meet
  only in the gradient buckets' waits; uncompiled programs only);

and ``lower_simplify.py`` removes the ops that compute nothing (identity views, detaches, transposes of
transposes, unread attention forwards) that the trace through DTensor leaves, and (uncompiled) calls the
common ops left through torch's Python bindings (``call_through_bindings``). A pipeline chunk whose
backward graph runs no collective and that recomputes nothing runs its forward under eager autograd
instead, its backward in autograd's C++ engine (``lower_eager.py``, ``LoweredProgram.eager``).

Passes of the DTensor program that become graph properties here:

* reshard after forward (``reshard.py``): its saved-tensor hooks cannot run inside a trace; instead
  every forward value computed from parameters alone (their casts, views and gathers) is tagged
  ``MUST_RECOMPUTE`` in the joint graph, so the partitioner saves the shards and gathers again in
  backward: the same collectives, one regather per gathered value backward reads.
* values made again in backward (``rematerialize.py``): likewise, the ops ``Remembered`` marked are tagged
  ``MUST_RECOMPUTE``, so the partitioner saves their inputs and the backward graph recomputes them.
* ``run_locally.py``'s ``to_local``/``from_local`` trace like any op.
* activation checkpointing (``checkpoint.py``): ``torch.utils.checkpoint`` under AOT tracing records
  the recompute in the backward graph.

The partition is AOT autograd's default one (what eager autograd saves), not inductor's min-cut, so the
lowered program keeps what the plan priced. With ``compile=True`` the program is traced with inductor's
decompositions and each graph compiled by inductor's inner compiler (what ``torch.compile`` does
after Dynamo), which keeps the functional collectives (``all_reduce`` becomes its in-place form).

What changes with the runtime: the collective counts of FSDP (one gather and one reduce_scatter per
layer and kind, where DTensor issues one per parameter: ``LoweredProgram.buckets`` says what was
merged), and overlap: the gathers are prefetched and the reduce_scatters waited at the end, which
``planning/pricing.py`` counts on one-stage plans (priced for this runtime, ``roles.priced_runtime``) and
not under pipelines (priced for DTensor, whose FSDP collectives are on the critical path, one per
parameter); the gradient all_reduces are the plan's buckets either way. The first call pays the trace
(seconds; inductor's compilation: a minute or more on a small CPU).

Where we diverge from torch's own tools: ``torch.compile`` would add Dynamo's bytecode capture and its
guards to a program that is already an fx graph with fixed shapes; we hand the graph to AOT autograd
directly (``aot_module_simplified``), so nothing is checked per call. That is sound because the
runtime's inputs never change their metadata between steps (``runtime/inputs.check_user_inputs``
refuses other shapes and dtypes; parameters keep their placements). One lowering per grad mode: a
forward traced without grad has no backward graph. SimpleFSDP (torchtitan) marks its gathers for
recomputation with a checkpoint policy while tracing; our gathers come from DTensor's redistributes,
so the joint graph is tagged instead. Where a trace fails, ``LoweredProgram`` warns once, saying why,
and runs the DTensor program instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache
from torch._functorch import config as functorch_config
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import CheckpointPolicy

from autopar.ir.buffer_writes import write_values
from autopar.ir.layers import gather_unit

from .gradient_sync import GradientSync
from .lower_buckets import (bucket_gradient_reductions, bucket_gradient_scatters, bucket_parameter_gathers,
                            defer_bucket_waits, defer_output_waits, launch_from_inputs_first, launch_regathers_ahead,
                            reduce_gathered_sums, reduced_in_graph)
from .lower_direct import DirectGraphs
from .lower_eager import EagerForward, EagerRefused, eager_refusal, from_local as _from_local
from .lower_simplify import call_through_bindings, simplify_local_ops
from .lower_writes import writes_as_outputs
from .rematerialize import Rematerialized, tag_recomputed
from .reshard import ResavedParameters

_c10d = torch.ops._c10d_functional

COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                    "all_to_all_single": "all_to_all"}
"""Functional collectives of a lowered graph, by op name, to the kinds plans use (inductor turns
``all_reduce`` into its in-place form)."""


class LoweredProgram(nn.Module):
    """``program`` (a stage module of ``build_program``) run as its lowered forward and backward graphs.

    ``parameters``: argument position -> parameter name, for the arguments that are parameter values
    (what reshard after forward gathers again in backward, and what the gathers and gradient
    reduce_scatters are bucketed by: ``lower_buckets``). ``grad_sync``: the gradient sync whose
    reductions move into the backward graph (None: they stay outside, after it; the runtime passes
    None under gradient accumulation, which reduces once per step). ``compile``: inductor compiles the
    graphs. ``graphs`` holds, per grad mode, the forward and backward graphs of the lowering (for tests
    and reports), ``buckets`` what the bucketing merged; ``fallback`` says why the DTensor program runs
    instead, when it does. ``local`` (position -> spec) the parameters read as local tensors, their
    gradients stored as DTensors with the parameter's spec (``_local_parameters``); where that trace
    failed, ``dtensor_parameters`` says why (the program then runs with every parameter a DTensor).
    ``direct``: from its second call with grad, the graphs run without AOT autograd's runtime wrapper
    (``lower_direct.DirectGraphs``), where ``_direct_graphs`` finds they may.
    ``hooked_gradients`` (without ``grad_sync``: a pipeline chunk's, whose stage reduces its gradients
    after the last microbatch): the parameters are read as local tensors too, each gradient leaving the
    graph unreduced and stored as a DTensor in the placements it reached the parameter in (partial over
    the dims still to reduce, ``_HookedProgram``), then handed to the parameter's accumulation hooks, as
    autograd's accumulation would (where the gradient sync takes it from).
    """

    def __init__(self, program: nn.Module, parameters: Mapping[int, str], compile: bool = False,
                 grad_sync: GradientSync | None = None, hooked_gradients: bool = False):
        super().__init__()
        self.hooked_gradients = hooked_gradients and grad_sync is None
        self.gradient_placements: dict[int, tuple[Placement, ...]] = {}  # as ``_HookedProgram`` records them
        self.input_gradient_placements: dict[int, tuple[Placement, ...]] = {}  # likewise, of its other arguments
        self.eager: EagerForward | None = None  # the forward run under eager autograd (``_eager_forward``)
        self.accumulates_in_leaves = False  # set by the pipeline runtime: ``_leaf``
        self.files_in_last_backward = True  # the pipeline's: where ``filing_gradients`` runs, else after it
        self.eager_refused: str | None = None  # why a hooked program's forward keeps AOT's graphs
        self._gradient_specs: dict[int, DTensorSpec] = {}  # of those placements (``_hooked_spec``)
        self.regathers = isinstance(program, ResavedParameters)
        inner = program.program if self.regathers else program
        self.recomputes = isinstance(inner, Rematerialized)  # its marked ops are tagged instead (``_partition``)
        inner = inner.program if self.recomputes else inner
        # traced with its buffer writes as outputs, which ``_written`` writes (``lower_writes.py``)
        self.program, self.writes = writes_as_outputs(inner) if isinstance(inner, fx.GraphModule) else (inner, [])
        self.dtensor_program = program
        self.parameters = dict(parameters)
        self.compile = compile
        self.grad_sync = grad_sync
        self.graphs: dict[bool, dict[str, fx.GraphModule]] = {}
        self.buckets: dict[bool, dict[str, dict[str, list[int]]]] = {}  # as graphs; per kind, each bucket's merges
        self.fallback: str | None = None
        self._lowered: dict[bool, Callable[..., Any]] = {}
        self.deferred: dict[bool, fx.GraphModule] = {}  # as graphs: the loss's end, run by ``finish``
        self._pending: tuple[torch.Tensor, fx.GraphModule, list[Any]] | None = None
        self.local: dict[int, DTensorSpec] | None = None  # as the class says; set at the first call
        self._leaves: dict[int, tuple[DTensor, torch.Tensor, torch.Tensor]] = {}  # ``_leaf``'s
        self.leaves_made = 0  # by ``_leaf``, over all calls
        self.dtensor_parameters: str | None = None  # as the class says
        self._runners: dict[bool, dict[str, Callable[[list[Any]], Any]]] = {}  # as graphs: what runs each
        self.direct: DirectGraphs | None = None  # the graphs called without AOT's wrapper (``lower_direct.py``)

    def forward(self, *args: Any) -> Any:
        outputs = self.start(*args)
        self.finish()
        return outputs

    def start(self, *args: Any) -> Any:
        """The program's outputs, the loss's last reduction possibly still in flight: its value may be
        read only after ``finish()`` (which ``forward`` calls at once; ``ParallelModule.step`` after
        backward, which does not read it)."""
        if self.fallback is not None:
            return self.dtensor_program(*args)
        grad = torch.is_grad_enabled()
        if self.local is None:
            self.local = self._local_parameters(args)
        inputs = self._with_leaves(args)
        first = grad not in self._lowered
        if first:
            lowered = self._lower(args, inputs, grad)
            if lowered is None and self.local and not self._lowered and self.fallback is not None:
                self.dtensor_parameters, self.fallback = self.fallback, None  # traced again, parameters as DTensors
                self.local, inputs = {}, list(args)
                lowered = self._lower(args, inputs, grad)
            if lowered is None:
                return self.dtensor_program(*args)
            self._lowered[grad] = lowered
            if grad and self.hooked_gradients:
                self.eager = self._eager_forward(args)
        if grad and self.eager is not None:
            return self._written(self.eager(inputs))
        if grad and self.direct is not None:
            return self._written(self.direct(inputs))
        outputs = self._lowered[grad](*inputs)
        if grad and first:
            self.direct = self._direct_graphs(inputs, outputs)
        return self._written(outputs)

    def _written(self, outputs: Sequence[Any]) -> Sequence[Any]:
        """The program's own outputs, the values it writes into buffers after them written there
        (``lower_writes.py``)."""
        if not self.writes:
            return outputs
        own = len(outputs) - len(self.writes)
        write_values(self.writes, outputs[own:])
        return outputs[:own]

    def _direct_graphs(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> DirectGraphs | None:
        """The graphs just lowered with grad, called without AOT autograd's runtime wrapper from the next call on
        (``lower_direct.py``), where the program reduces its gradients in them (a one-stage program's) and
        inductor does not compile them; None: AOT's wrapper keeps running them."""
        runners = self._runners.get(True, {})
        if self.compile or self.grad_sync is None or set(runners) != {"forward", "backward"}:
            return None
        graphs = self.graphs[True]
        extra = len(self.deferred[True].graph.find_nodes(op="placeholder")) if True in self.deferred else 0
        returned = len(next(n for n in graphs["forward"].graph.nodes if n.op == "output").args[0]) - extra
        return DirectGraphs.of(graphs["forward"], graphs["backward"], (runners["forward"], runners["backward"]),
                               inputs, outputs, returned)

    def start_locally(self, *args: Any) -> Any:
        """``start`` for a program that runs under eager autograd (``eager``), its DTensor arguments that
        ``EagerForward.reads_locally`` may take as local tensors given so, and its outputs as local tensors
        (``EagerForward.writes_locally``): a pipeline chunk's received and sent values, without DTensor's
        wrapping and unwrapping on each side of every microbatch."""
        return self._written(self.eager(self._with_leaves(args), local_outputs=True))

    def _eager_forward(self, args: Sequence[Any]) -> EagerForward | None:
        """The forward of a pipeline chunk (``hooked_gradients``), just lowered with grad, traced alone to run
        under eager autograd (``lower_eager.py``), or None where it keeps the AOT graphs (``eager_refused``
        says why)."""
        graphs = self.graphs[True]
        self.eager_refused = eager_refusal(self.program, graphs, self.collectives(), list(self.parameters),
                                           self.local or {}, self.compile)
        if self.eager_refused is not None:
            return None
        try:
            return EagerForward.traced(self.program, args, self.local or {}, self.input_gradient_placements)
        except EagerRefused as exc:
            self.eager_refused = str(exc)
        except Exception as exc:  # noqa: BLE001: the AOT graphs, traced already, run instead
            self.eager_refused = f"its forward could not be traced alone ({type(exc).__name__}: {exc})".splitlines()[0]
        return None

    def finish(self) -> None:
        """Complete the loss of the last ``start``: wait on its reduction and compute its value from
        there (``lower_buckets.defer_output_waits``' graph), written into the loss ``start`` returned; under
        eager autograd, the losses of every call since the last ``finish`` (``EagerForward.finish``)."""
        if self.eager is not None:
            self.eager.finish()
        if self._pending is None:
            return
        slot, epilogue, inputs = self._pending
        self._pending = None
        with torch.no_grad():
            slot.copy_(epilogue(*inputs))

    def collectives(self, grad: bool = True) -> dict[str, dict[str, int]]:
        """Per graph (``forward``, ``backward``), the collectives one run of it issues, per kind."""
        return {name: graph_collectives(gm) for name, gm in self.graphs.get(grad, {}).items()}

    def _with_leaves(self, args: Sequence[Any]) -> list[Any]:
        """``args`` with each parameter the program reads as a local tensor replaced by its leaf (``_leaf``)."""
        return [self._leaf(i, a) if i in self.local else a for i, a in enumerate(args)]

    def _leaf(self, position: int, param: DTensor) -> torch.Tensor:
        """The leaf the program reads for ``param``, the argument at ``position`` (``_local_leaf``): the last
        call's where it stands for the same parameter, local tensor and grad mode and holds no gradient
        (its hook stores each one and lets it go). A pipeline chunk runs once per microbatch on the same
        parameters; a new leaf and its hook cost about 10 us a parameter each time.

        With ``accumulates_in_leaves`` (set by the pipeline runtime where no consumer needs a gradient before
        the step's last backward: not under ZeRO-2, no parameter read by two of a rank's chunks) the leaf has
        no hook and is kept though it holds a gradient: autograd's engine sums the microbatches' gradients
        into it in C++, and ``filing_gradients`` hooks it for the step's last backward, which stores the sum
        once, where a hook stored each microbatch's from Python (144 calls a step on the benchmark's GPT
        stage, about 2 ms of its 45)."""
        kept = self._leaves.get(position)
        if kept is not None and kept[0] is param and kept[1] is param._local_tensor \
                and kept[2].requires_grad == torch.is_grad_enabled() \
                and (kept[2].grad is None or self.accumulates_in_leaves):
            return kept[2]
        leaf = _local_leaf(param, self._hooked_spec(position, param), hooked=not self.accumulates_in_leaves)
        self._leaves[position] = (param, param._local_tensor, leaf)
        self.leaves_made += 1
        return leaf

    def forget_unfinished_step(self) -> None:
        """Drop what a step that stopped early left: the sums in the kept leaves (``accumulates_in_leaves``: a
        step's are filed in its last backward), the losses not finished (``EagerForward.pending``) and the
        input sums reduced for microbatches that did not run (``EagerForward.reductions``)."""
        for _, _, leaf in self._leaves.values():
            leaf.grad = None
        if self.eager is not None:
            self.eager.pending.clear()
            if self.eager.reductions is not None:
                self.eager.reductions.forget()

    @contextlib.contextmanager
    def filing_gradients(self) -> Iterator[None]:
        """While the step's last backward runs (``accumulates_in_leaves``): each kept leaf hooked to store the
        sum of its microbatches' gradients as its parameter's once autograd has added the last one, and run
        the parameter's accumulation hooks (where the gradient sync and ZeRO-1 take it, overlapped with the
        rest of that backward as with a hook per microbatch)."""
        handles = [leaf.register_post_accumulate_grad_hook(_storing(param, self._hooked_spec(position, param)))
                   for position, (param, _, leaf) in self._leaves.items() if leaf.requires_grad]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def file_leaf_gradients(self) -> None:
        """Store the sums the kept leaves hold (``accumulates_in_leaves``) as their parameters' gradients, and
        run the parameters' accumulation hooks, now: what ``filing_gradients`` does in the last backward, for a
        chunk whose last backward has nothing to overlap the reductions with, or that another stage waits on
        (the pipeline calls this after its schedule instead: ``files_in_last_backward`` False)."""
        for position, (param, _, leaf) in self._leaves.items():
            if leaf.grad is not None:
                _store_gradient(param, leaf, self._hooked_spec(position, param))

    def _hooked_spec(self, position: int, param: DTensor) -> Callable[[], DTensorSpec] | None:
        """For hooked gradients, what gives the spec of the gradient of ``param``, the argument at
        ``position``: in the placements recorded when the backward was traced, one object for every call."""
        if not self.hooked_gradients:
            return None

        def spec() -> DTensorSpec:
            if position not in self._gradient_specs:
                self._gradient_specs[position] = DTensorSpec(param.device_mesh, self.gradient_placements[position],
                                                             tensor_meta=param._spec.tensor_meta)
            return self._gradient_specs[position]
        return spec

    def _local_parameters(self, args: Sequence[Any]) -> dict[int, DTensorSpec]:
        """Argument position -> its parameter's spec, for the parameters the program reads as local
        tensors (``_local_leaf``): those the in-graph gradient sync reduces (their gradients leave the
        graph in the parameter's placements), when they are DTensor leaves. Their gradients are then
        plain tensors, made DTensors once, with the spec, where AOT's wrapper would make each a DTensor
        and autograd accumulate it through DTensor's dispatch (about 0.1 ms a gradient). Where that
        trace fails nonetheless, ``start`` traces the program again with every parameter a DTensor and
        ``dtensor_parameters`` says why."""
        if self.grad_sync is None and not self.hooked_gradients:
            return {}
        synced = {id(p) for p in self.grad_sync.params} if self.grad_sync is not None else None
        local = {i: args[i]._spec for i in self.parameters if (synced is None or id(args[i]) in synced)
                 and isinstance(args[i], DTensor) and args[i].is_leaf and args[i].requires_grad}
        meshes = [a.device_mesh for a in args if isinstance(a, DTensor)]
        kept = [a for i, a in enumerate(args) if isinstance(a, DTensor) and i not in local]
        one_mesh = all(mesh == meshes[0] for mesh in meshes)
        return local if one_mesh and kept else {}  # the traced mesh is a kept DTensor's: _ReducingProgram

    def _lower(self, args: Sequence[Any], inputs: Sequence[Any], grad: bool) -> Callable[..., Any] | None:
        """The program traced for ``args`` (the DTensor program's), called with ``inputs`` (``start``'s)."""
        graphs: dict[str, fx.GraphModule] = {}
        buckets: dict[str, dict[str, list[int]]] = {}
        units = self._units(inputs)
        partition = self._partition(flat_positions(inputs, list(self.parameters)))
        _forget_propagated_meshes()
        try:
            # non-lazy: a backward failure shows here
            with functorch_config.patch(force_non_lazy_backward_lowering=True), self._tracing():
                lowered = aot_module_simplified(
                    self._marked(args), list(inputs), fw_compiler=self._keep("forward", graphs, buckets, units, grad),
                    bw_compiler=self._keep("backward", graphs, buckets, units, grad),
                    inference_compiler=self._keep("forward", graphs, buckets, units, grad),
                    partition_fn=partition, decompositions=_inductor_decompositions() if self.compile else None)
        except Exception as exc:  # noqa: BLE001: any failure to trace leaves the DTensor program, said once
            self.fallback = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            if not self.local or self._lowered:  # else traced again with DTensor parameters first (``start``)
                warnings.warn(f"autopar: the program could not be lowered ({self.fallback}); running it on DTensor",
                              stacklevel=4)
            return None
        self.graphs[grad] = graphs
        self.buckets[grad] = buckets
        return lowered

    def _tracing(self) -> contextlib.AbstractContextManager[Any]:
        """Where inductor compiles, a tracing context as Dynamo gives ``torch.compile``'s: through it the
        compiled forward reports the strides it chose for what it saves (inductor pads a row of 50,257
        bf16 elements to 50,304 on GPUs, ``comprehensive_padding``), and AOT autograd compiles the
        backward for those strides. Without one the backward asserts the unpadded strides it was traced
        with and fails on its first call."""
        if not self.compile:
            return contextlib.nullcontext()
        return tracing(TracingContext(FakeTensorMode()))

    def _marked(self, args: Sequence[Any]) -> nn.Module:
        """The program to trace: with ``grad_sync``, the parameters it reduces marked to be reduced in
        the backward graph (``lower_buckets.reduced_in_graph``)."""
        if self.grad_sync is None:
            return _HookedProgram(self.program, self.local, self.gradient_placements, self.input_gradient_placements) \
                if self.local else self.program
        synced = {id(p) for p in self.grad_sync.params}
        return _ReducingProgram(self.program, [i for i in self.parameters if id(args[i]) in synced],
                                self.grad_sync.reduce_dtype, self.local or {})

    def _units(self, args: Sequence[Any]) -> dict[str, str]:
        """Parameter placeholder name of the traced graphs (``primals_<i+1>``) -> the unit its gathers
        and gradient reduce_scatters are bucketed by: its layer, or outside layers its module."""
        return {f"primals_{k + 1}": gather_unit(fqn)
                for i, fqn in self.parameters.items() for k in flat_positions(args, [i])}

    def _keep(self, name: str, graphs: dict[str, fx.GraphModule], buckets: dict[str, dict[str, list[int]]],
              units: Mapping[str, str], grad: bool) -> Callable[..., Any]:
        """An AOT compiler that records the graph it is given, its collectives bucketed
        (``bucketed``), and runs it (compiled by inductor when ``compile``; else a forward's loss
        finished by ``finish``, ``defer_output_waits``: kept in ``deferred[grad]``)."""
        def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            buckets[name] = self.bucketed(name, gm, units)
            graphs[name] = gm
            if self.compile:
                from torch._inductor.compile_fx import compile_fx_inner

                return compile_fx_inner(gm, example_inputs, is_backward=name == "backward")
            epilogue = defer_output_waits(gm) if name == "forward" else None
            if name == "backward" and self.local:  # their gradients' filing is ``_store_gradient``'s
                defer_bucket_waits(gm, self.finish)
            call_through_bindings(gm)
            if epilogue is not None:
                call_through_bindings(epilogue)
                self.deferred[grad] = epilogue
            runner = _boxed(gm) if epilogue is None else self._deferring(gm, epilogue)
            self._runners.setdefault(grad, {})[name] = runner
            return runner
        return compiler

    def _deferring(self, gm: fx.GraphModule, epilogue: fx.GraphModule) -> Callable[..., Any]:
        """``gm`` (a forward graph ``defer_output_waits`` rewrote: its loss, output 0, is finished by
        ``epilogue`` from the values ``gm`` returns after its own outputs) run as AOT autograd calls it,
        the loss's end kept for ``finish``. The program returns its loss first and mutates no input
        (``build_program``'s programs are functional), so AOT's wrapper hands out that slot as the loss."""
        run = _boxed(gm)
        extra = len(epilogue.graph.find_nodes(op="placeholder"))

        def deferring(args: list[Any]) -> Any:
            outputs = run(args)
            own, inputs = outputs[:len(outputs) - extra], list(outputs[len(outputs) - extra:])
            self._pending = (own[0], epilogue, inputs)
            return own
        deferring._boxed_call = True  # type: ignore[attr-defined]
        return deferring

    def bucketed(self, name: str, gm: fx.GraphModule, units: Mapping[str, str]) -> dict[str, list[int]]:
        """``lower_buckets``' and ``lower_simplify``'s passes on the graph ``name`` (``forward``,
        ``backward``), in place: per kind, each bucket's count of collectives it replaces (gradient
        reductions: gradients); ``summed_gather``: a 1 per all_gather run as an all_reduce instead."""
        made = {"all_gather": bucket_parameter_gathers(gm, units)}
        if name == "backward":
            made["reduce_scatter"] = bucket_gradient_scatters(gm, units)
            if self.grad_sync is not None:
                made["all_reduce"] = bucket_gradient_reductions(gm, self.grad_sync.bucket_bytes)
        made["summed_gather"] = [1] * reduce_gathered_sums(gm)
        # not in backward, whose inputs are the saved activations: launched together at its start, every
        # layer's gathered copy would be alive at once
        if name == "forward":
            launch_from_inputs_first(gm, units)
        else:  # the saved shards' gathers again, a matmul ahead of their readers
            launch_regathers_ahead(gm)
        simplify_local_ops(gm)
        return {kind: counts for kind, counts in made.items() if counts}

    def _partition(self, parameter_primals: Sequence[int]) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
        """AOT autograd's default partition, parameter values recomputed in backward when the DTensor program
        regathers them, and the values it makes again in backward recomputed (``rematerialize.py``). Where
        inductor compiles, its joint-graph passes run first, as ``torch.compile``'s partition runs them: among
        them ``pad_mm``, which on GPUs pads a matmul whose dimensions break the tensor cores' alignment (GPT-2's
        50,257-token head) where it measures faster."""
        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            drop_checkpoint_tags(joint)
            if self.compile:
                from torch._inductor.fx_passes.joint_graph import joint_graph_passes

                joint = joint_graph_passes(joint)
            if self.regathers:
                recompute_parameter_values(joint, parameter_primals)
            if self.recomputes:
                tag_recomputed(joint)
            return default_partition(joint, joint_inputs, **kwargs)
        return partition


class _ReducingProgram(nn.Module):
    """``program`` reading the arguments at ``positions`` through ``reduced_in_graph``; those at
    ``local``'s positions come as local tensors, made DTensors with their spec first."""

    def __init__(self, program: nn.Module, positions: Sequence[int], reduce_dtype: torch.dtype | None,
                 local: Mapping[int, DTensorSpec]):
        super().__init__()
        self.program = program
        self.positions = frozenset(positions)
        self.reduce_dtype = reduce_dtype
        self.local = dict(local)

    def forward(self, *args: Any) -> Any:
        mesh = _traced_mesh(args, self.local) if self.local else None
        values = [_from_local(a, mesh, self.local[i]) if i in self.local else a for i, a in enumerate(args)]
        return self.program(*(reduced_in_graph(a, self.reduce_dtype) if i in self.positions else a
                              for i, a in enumerate(values)))


def _forget_propagated_meshes() -> None:
    """Empty DTensor's sharding propagation cache (its C++ fast path's), so that the values the trace
    computes are on the meshes of the program's inputs.

    That cache is keyed on the inputs' specs, whose meshes compare by value (``DeviceMesh.__eq__``: ranks,
    layout, dim names), and hands back the output spec of the first hit, holding the mesh of the program
    that filled it. A second program of the process (its own, equal mesh) then gets a loss on the first
    program's mesh: a mesh object that is none of the traced inputs. AOT autograd flattens the loss's
    tangent to its local tensor and that mesh, and make_fx tracks opaque objects by their real object,
    first placeholder first (``proxy_tensor.set_proxy_slot``): the forward's mesh output becomes the
    tangent placeholder, which the partitioner refuses ("Node tangents_2 was invalid, but is output").
    The program's own mesh, a primal, is tracked first; emptied, the cache can give back no other."""
    _clear_fast_path_sharding_prop_cache()


def _traced_mesh(args: Sequence[Any], local: Mapping[int, DTensorSpec]) -> DeviceMesh:
    """The arguments' one mesh, as traced: a DTensor argument's other than those at ``local``'s positions,
    which come as local tensors (a real mesh made beside it would be a second mesh)."""
    return next(a.device_mesh for i, a in enumerate(args) if isinstance(a, DTensor) and i not in local)


def lowering_of(module: nn.Module) -> dict[str, Any]:
    """What of ``module`` (a runtime module) runs lowered: its ``LoweredProgram``s (and of them, how many inductor
    compiles, how many call their graphs without AOT autograd's runtime wrapper, ``lower_direct.py``, how many
    run their forward under eager autograd, ``lower_eager.py``, of those how many have
    sums of their inputs reduced ahead of a pipeline's schedule, ``lower_eager.InputReductions``, and why the
    other pipeline chunks do not run eagerly), why any runs its DTensor program instead
    (``LoweredProgram.fallback``, set once it was traced), how many parameters they read as local tensors and
    how many leaves they made for them over all calls (``LoweredProgram._leaf``), and why any reads them as
    DTensors (``LoweredProgram.dtensor_parameters``)."""
    programs = [m for m in module.modules() if isinstance(m, LoweredProgram)]
    return {"programs": len(programs), "compiled": sum(p.compile for p in programs),
            "eager": sum(p.eager is not None for p in programs),
            "direct": sum(p.direct is not None for p in programs),
            "input_sums_ahead": sum(p.eager is not None and p.eager.reductions is not None for p in programs),
            "eager_refused": [p.eager_refused for p in programs if p.eager_refused is not None],
            "fallbacks": [p.fallback for p in programs if p.fallback is not None],
            "local_parameters": sum(len(p.local or {}) for p in programs),
            "leaves_made": sum(p.leaves_made for p in programs),
            "dtensor_parameters": [p.dtensor_parameters for p in programs if p.dtensor_parameters is not None]}


def _local_leaf(param: DTensor, spec: Callable[[], DTensorSpec] | None = None, hooked: bool = True) -> torch.Tensor:
    """A leaf on ``param``'s local tensor whose gradient, once accumulated, becomes ``param``'s as a
    DTensor (added to the one it holds), so the program's backward hands out a plain tensor: with
    ``param``'s spec; with ``spec()`` (hooked gradients, ``LoweredProgram``), and the parameter's
    accumulation hooks run after. Without ``hooked`` the gradient stays on the leaf, summed there by
    autograd (``LoweredProgram.filing_gradients`` stores it)."""
    leaf = param._local_tensor.detach().requires_grad_(torch.is_grad_enabled())
    if leaf.requires_grad and hooked:
        leaf.register_post_accumulate_grad_hook(_storing(param, spec))
    return leaf


def _storing(param: DTensor, spec: Callable[[], DTensorSpec] | None) -> Callable[[torch.Tensor], None]:
    """A leaf's post-accumulate hook storing its gradient as ``param``'s (``_store_gradient``)."""
    return lambda local: _store_gradient(param, local, spec)


def _store_gradient(param: DTensor, local: torch.Tensor, spec_of: Callable[[], DTensorSpec] | None = None) -> None:
    """``local``'s gradient added to ``param``'s as a DTensor of ``spec_of()`` (else ``param``'s spec): in
    place, on its local tensor, where ``param``'s gradient is one this stored in the same spec (a later
    microbatch's: no DTensor dispatch), and ``param``'s accumulation hooks run after where ``spec_of``. A
    parameter the step does not use has no gradient: its backward hands autograd none (its leaf's hook still
    runs), and, as in single-process training, it keeps none (the traced backward recorded no placement for it)."""
    if local.grad is None:
        return
    spec = param._spec if spec_of is None else spec_of()
    if param.grad is not None:  # read: its bucket's reduction done first (``lower_buckets.defer_bucket_waits``)
        _c10d.wait_tensor(local.grad)
    if param.grad is not None and param.grad._spec is spec:
        param.grad._local_tensor.add_(local.grad)
    else:
        grad = DTensor(local.grad, spec, requires_grad=False)
        param.grad = grad if param.grad is None else param.grad + grad
    local.grad = None
    if spec_of is not None:  # as autograd's accumulation would: where the gradient sync takes it from
        for hook in tuple((param._post_accumulate_grad_hooks or {}).values()):
            hook(param)


class _HookedProgram(nn.Module):
    """``program`` reading the arguments at ``local``'s positions as local tensors (``_HookedParameter``),
    their gradients left unreduced and their placements recorded in ``placements`` when traced; those of
    its other DTensor arguments that need a gradient (a pipeline chunk's received activations) recorded
    in ``input_placements`` (what ``lower_eager.EagerForward`` gives them)."""

    def __init__(self, program: nn.Module, local: Mapping[int, DTensorSpec],
                 placements: dict[int, tuple[Placement, ...]], input_placements: dict[int, tuple[Placement, ...]]):
        super().__init__()
        self.program, self.local, self.placements = program, dict(local), placements
        self.input_placements = input_placements

    def forward(self, *args: Any) -> Any:
        mesh = _traced_mesh(args, self.local)
        for i, a in enumerate(args):
            if i not in self.local and isinstance(a, DTensor) and a.requires_grad:
                a.register_hook(_placements_recorder(i, self.input_placements))
        return self.program(*(_HookedParameter.apply(a, mesh, self.local[i], i, self.placements)
                              if i in self.local else a for i, a in enumerate(args)))


def _placements_recorder(position: int, placements: dict[int, tuple[Placement, ...]]) -> Callable[[DTensor], None]:
    """A gradient hook recording, as the backward is traced, the placements of the gradient of the argument
    at ``position`` in ``placements[position]``."""
    def record(grad: DTensor) -> None:
        placements[position] = tuple(grad.placements)
    return record


class _HookedParameter(torch.autograd.Function):
    """A local parameter shard as the DTensor of ``spec``, whose gradient leaves as its local tensor, partial
    where it arrives partial on a dim ``spec`` replicates (``DTensor.from_local``'s backward would reduce it
    there for every microbatch; the gradient sync reduces it once) and in ``spec``'s placements on the others
    (a gradient arriving whole or partial for a parameter sharded on that dim, as where a weight reads both a
    value and its detached copy, is cut to or reduce-scattered onto the shard, as DTensor would), those
    placements recorded in ``placements[position]`` as the backward is traced."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh, spec: DTensorSpec, position: int,
                placements: dict[int, tuple[Placement, ...]]) -> DTensor:
        ctx.position, ctx.placements, ctx.spec = position, placements, spec
        return _from_local(local, mesh, spec)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Any, ...]:
        kept = tuple(have if have.is_partial() and want.is_replicate() else want
                     for have, want in zip(grad.placements, ctx.spec.placements))
        if kept != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, kept)
        ctx.placements[ctx.position] = kept
        return grad._local_tensor, None, None, None, None


def flat_positions(args: Sequence[Any], positions: Sequence[int]) -> list[int]:
    """Where the tensors ``args[i]`` (``i`` in ``positions``) desugar to among the joint graph's
    ``primals``: a tensor subclass is as many primals as its flattened inner values (a DTensor: its local
    tensor and its device mesh, AOT autograd's ``unwrap_tensor_subclasses``)."""
    starts, n = [], 0
    for arg in args:
        starts.append(n)
        n += _flat_count(arg)
    return [starts[i] + k for i in sorted(set(positions)) for k in range(_flat_count(args[i]))]


def _flat_count(value: Any) -> int:
    """How many of AOT autograd's flat inputs ``value`` becomes."""
    if is_traceable_wrapper_subclass(value):
        inner, _ = value.__tensor_flatten__()
        return sum(_flat_count(getattr(value, name)) for name in inner)
    return 1


def drop_checkpoint_tags(joint: fx.GraphModule) -> None:
    """Remove the recompute tags ``torch.utils.checkpoint``'s selective policy left on ``joint``'s nodes.

    Traced by AOT autograd directly (not through Dynamo's checkpoint operator), a checkpointed layer's
    recomputation is already in the backward part of the joint graph, reading only what the layer's
    policy saved; its tags, which carry no region id (``ac_graph_id``), would make the partitioner
    recompute again (and its region comparison fails on them)."""
    for node in joint.graph.nodes:
        if "ac_graph_id" in node.meta and node.meta["ac_graph_id"] is None:
            node.meta.pop("ac_graph_id")
            node.meta.pop("recompute", None)


def recompute_parameter_values(joint: fx.GraphModule, parameter_primals: Sequence[int]) -> int:
    """Tag every op of ``joint`` computed from parameter inputs alone (``primals`` at
    ``parameter_primals``: casts, views, gathers) to be recomputed in backward rather than saved;
    returns how many."""
    primals = [node for node in joint.graph.nodes if node.op == "placeholder" and node.name.startswith("primals")]
    from_parameters = {primals[i] for i in parameter_primals}
    tagged = 0
    for node in joint.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(n in from_parameters for n in inputs):
            from_parameters.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged


def graph_collectives(gm: fx.GraphModule) -> dict[str, int]:
    """The collectives ``gm`` issues per run, per kind (``COLLECTIVE_KINDS``)."""
    found: Counter[str] = Counter()
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional":
            name = target._overloadpacket.__name__
            if name != "wait_tensor":
                found[COLLECTIVE_KINDS.get(name, name)] += 1
    return dict(found)


def _inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions inductor compiles from (what ``torch.compile`` hands AOT autograd)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _boxed(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm`` called AOT autograd's boxed way (one list of arguments, cleared as it is read)."""
    def run(args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        return gm(*inputs)
    run._boxed_call = True  # type: ignore[attr-defined]
    return run
