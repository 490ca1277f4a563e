"""Mesh candidates: every factorization of the world into pipeline stages and, per stage, data- and
tensor-parallel mesh dims (HSDP's ``dp_replicate`` beside ``dp`` when the data-parallel group leaves
a node; an expert-parallel ``ep`` dim carved out of the data-parallel group when the model has experts),
filtered by the constraints and the topology, and the microbatch counts each allows.

Unless pinned, ``tp`` stays inside a node (tensor parallelism all-reduces on the critical path, so it
belongs on NVLink) and ``pp`` divides the node count (stages span whole nodes; Narayanan et al.,
SC21). A size-1 dimension is dropped. ``MeshChoice`` is one candidate: a stage's submesh and the
number of stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.axes import MeshAxis
from autopar.core.constraints import Constraints
from autopar.core.errors import BadInputError
from autopar.cost_models import Cluster
from autopar.core.batch import batch_carriers, batch_size_of
from autopar.ir.capture import CapturedGraph


@dataclass(frozen=True)
class MeshChoice:
    """A stage submesh (``dims``: axis and size per dim) and how many pipeline stages share the world."""

    dims: tuple[tuple[MeshAxis, int], ...]  # (axis, size) per mesh dim of one stage
    stages: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def names(self) -> tuple[MeshAxis, ...]:
        return tuple(n for n, _ in self.dims)

    def size(self, axis: MeshAxis) -> int:
        """The size of mesh dim ``axis``; 1 when the stage mesh has no such dim."""
        return dict(self.dims).get(axis, 1)

    @property
    def data_parallel_size(self) -> int:
        """Ranks of a stage that each work on their own share of the batch: the product of the
        data-parallel dims (HSDP: replica groups x shard group) and the expert-parallel dim, which
        splits the batch too. The plan's ``degrees["dp"]``."""
        return self.size(MeshAxis.DP_SHARD) * self.size(MeshAxis.DP_REPLICATE) * self.size(MeshAxis.EP)

    def dims_of(self, *axes: MeshAxis) -> list[int]:
        """Indices of the dims of ``axes`` larger than 1."""
        return [i for i, (n, s) in enumerate(self.dims) if n in axes and s > 1]

    def to_dict(self) -> dict[str, list]:
        """The plan's ``mesh`` section: ``shape`` and ``dim_names``."""
        return {"shape": list(self.shape), "dim_names": [axis.value for axis in self.names]}

    def describe(self) -> dict[str, int]:
        """Stages and dim sizes, as ``solver.pruned_meshes`` lists them."""
        return {**({MeshAxis.PP.value: self.stages} if self.stages > 1 else {}),
                **{axis.value: s for axis, s in self.dims}}


def mesh_candidates(cluster: Cluster, constraints: Constraints, batch: int | None,
                    layers: int = 0, experts: int = 0) -> list[MeshChoice]:
    """Every ``pp x dp x cp x tp`` factorization of the world the constraints and topology allow (``cp``
    as pinned; ``search.context_parallel_meshes`` pins each degree it tries), pipeline
    degree first (1 first), then tensor-parallel degree. Unless pinned, ``tp`` stays inside a node
    (its all_reduces are on the critical path) and ``pp`` divides the node count (a stage spans whole
    nodes, so only stage-to-stage transfers cross the network; Narayanan et al., SC21). With
    ``experts`` (the number of experts every expert weight is split into; 0 for a dense model), each
    data-parallel group is also tried with an ``ep`` dim (``expert_degrees``), which a ``cp`` dim goes
    outside of: ``cp x ep``, so the ep all_to_alls move the dispatched tokens of a value split on the same
    dim over cp without gathering it (DTensor moves the innermost split of a dim in place)."""
    world = cluster.world_size
    cp = constraints.cp or 1  # context parallelism: the search tries each degree as pinned
    fixed = {"pp": constraints.pp, "dp": constraints.dp, "tp": constraints.tp}  # pinned degrees, by constraint key
    if fixed["dp"] and fixed["tp"] and not fixed["pp"] and world % (fixed["dp"] * fixed["tp"] * cp) == 0:
        fixed["pp"] = world // (fixed["dp"] * fixed["tp"] * cp)  # dp and tp pinned: the rest are stages
    _check_fixed_degrees(cluster, {**fixed, "cp": constraints.cp}, layers, constraints)
    out = []
    for pp in _divisors(world // cp):
        if fixed["pp"] and pp != fixed["pp"] or not fixed["pp"] and not _free_stages_ok(pp, cluster, layers):
            continue
        for tp in _divisors(world // (pp * cp)):
            dp = world // (pp * tp * cp)
            if (fixed["tp"] and tp != fixed["tp"]) or (fixed["dp"] and dp != fixed["dp"]):
                continue
            if not fixed["tp"] and tp > cluster.devices_per_node:
                continue  # keep tensor parallelism on NVLink unless asked otherwise
            if tp == 1 and constraints.sp == 1:
                continue  # sequence parallelism splits over the tp dim
            if batch is not None and batch % dp:
                if fixed["dp"]:
                    raise BadInputError(f"global batch {batch} is not divisible by dp={dp}")
                continue
            for replicas, ep in _data_parallel_splits(cluster, constraints, dp, tp, experts):
                named = ((MeshAxis.DP_REPLICATE, replicas), (MeshAxis.DP_SHARD, dp // (replicas * ep)),
                         (MeshAxis.CP, cp), (MeshAxis.EP, ep), (MeshAxis.TP, tp))
                dims = tuple((n, s) for n, s in named if s > 1) or ((MeshAxis.DP_SHARD, 1),)
                out.append(MeshChoice(dims, pp))
    if not out and constraints.ep not in (None, 1):
        raise BadInputError(f"constraint ep={constraints.ep} needs a model with experts, ep dividing the "
                            f"number of experts ({experts or 'none here'}) and the data-parallel degree, and no "
                            f"mesh of the {world} devices of {cluster.spec} has one")
    if not out and cp > 1:
        raise BadInputError(f"constraint cp={cp}: no mesh of the {world} devices of {cluster.spec} has a cp dim "
                            "(the global batch divisible by dp = devices / (pp x cp x tp))")
    if not out and constraints.sp == 1:
        raise BadInputError(f"constraint sp=1 needs a tp mesh dim (tp > 1), and no mesh of the {world} devices "
                            f"of {cluster.spec} has one (tp <= {cluster.devices_per_node} devices per node"
                            + (f", global batch {batch}" if batch is not None else "") + ")")
    if not out and any(fixed.values()):
        raise BadInputError(_pinned_degrees_cover_no_mesh(cluster, constraints, fixed, batch, layers))
    if not out:
        raise BadInputError(f"global batch {batch} cannot be split over any data-parallel degree of "
                            f"{world} devices with tp <= {cluster.devices_per_node}: use a batch divisible "
                            f"by {world // min(world, cluster.devices_per_node)}")
    return out


def _pinned_degrees_cover_no_mesh(cluster: Cluster, constraints: Constraints, fixed: dict[str, int | None],
                                  batch: int | None, layers: int) -> str:
    """Why no mesh of ``cluster`` has the pinned degrees ``fixed``: the rules the free ones follow."""
    pinned = ", ".join(f"{k}={v}" for k, v in fixed.items() if v)
    free = [k for k, v in fixed.items() if not v]
    rules = []
    if "tp" in free:
        rules.append(f"tp at most the {cluster.devices_per_node} devices of a node")
    if "pp" in free:
        rules.append(f"pp dividing the {cluster.nodes} node{'s' * (cluster.nodes > 1)} and at most the model's "
                     f"{layers} repeated layer{'s' * (layers != 1)}")
    if "dp" in free and batch is not None:
        rules.append(f"dp dividing the global batch ({batch})")
    if constraints.sp == 1:
        rules.append("tp > 1 (sp=1)")
    others = " x ".join(free + (["cp"] if constraints.cp else [])) or "none"
    followed = f", with {', '.join(rules)}" if rules else ""
    return (f"no mesh of the {cluster.world_size} devices of {cluster.spec} has {pinned}: the other degrees "
            f"({others}) must make up the rest of the devices{followed}; pin them too, or pin fewer")


def _data_parallel_splits(cluster: Cluster, constraints: Constraints, dp: int, tp: int, experts: int
                          ) -> list[tuple[int, int]]:
    """(HSDP replica groups, expert-parallel degree) pairs a data-parallel group of ``dp`` ranks is
    split into: the replica counts of ``_replica_counts`` without expert parallelism, and one
    replica group under each ``expert_degrees`` degree above 1."""
    plain = [(r, 1) for r in _replica_counts(cluster, constraints, dp, tp)] if constraints.ep in (None, 1) else []
    return plain + [(1, ep) for ep in expert_degrees(constraints, dp, experts) if ep > 1]


def expert_degrees(constraints: Constraints, dp: int, experts: int) -> list[int]:
    """Expert-parallel degrees for a data-parallel group of ``dp`` ranks: every divisor of ``dp`` that
    divides the number of experts (each rank holds whole experts, the same number), or the pinned
    ``ep``. HSDP is not combined with it (``dp_shard`` pinned leaves ``ep`` 1)."""
    if not experts or constraints.dp_shard is not None:
        return [1]
    found = [ep for ep in _divisors(dp) if experts % ep == 0]
    return [ep for ep in found if ep == constraints.ep] if constraints.ep is not None else found


def _replica_counts(cluster: Cluster, constraints: Constraints, dp: int, tp: int) -> list[int]:
    """HSDP replica groups to try for a data-parallel degree: 1 (plain DDP/FSDP), and, when the dp
    group leaves the node and parameters may be sharded, shard groups that fill a node's devices
    (parameter gathers on NVLink, only the gradient all_reduce across nodes; Zhao et al., VLDB 2023).
    ``dp_shard`` pins the shard group."""
    if constraints.dp_shard is not None:
        shard = constraints.dp_shard
        if dp % shard:
            return []
        return [dp // shard]
    shard = cluster.devices_per_node // tp
    if constraints.zero_stage not in (None, 3) or shard <= 1 or dp % shard or dp <= shard:
        return [1]
    return [1, dp // shard]


def _free_stages_ok(pp: int, cluster: Cluster, layers: int) -> bool:
    return pp == 1 or (cluster.nodes % pp == 0 and pp <= layers)


def _check_fixed_degrees(cluster: Cluster, fixed: dict[str, int | None], layers: int,
                         constraints: Constraints) -> None:
    world = cluster.world_size
    for key, value in fixed.items():
        if value and world % value:
            raise BadInputError(f"{key}={value} does not divide the {world} devices of {cluster.spec}")
    pinned = [v for v in fixed.values() if v]
    product = 1
    for v in pinned:
        product *= v
    if world % product or (len([k for k, v in fixed.items() if v and k != "cp"]) == 3 and product != world):
        raise BadInputError(" x ".join(f"{k}={v}" for k, v in fixed.items() if v)
                            + f" = {product} does not fit the {world} devices of {cluster.spec}")
    pp = fixed["pp"] or 1
    chunks = constraints.model_chunks
    if pp > 1 and chunks > 1 and pp * chunks > layers:
        raise BadInputError(f"pp={pp} with {chunks} virtual stages needs {pp * chunks} layers; the model has {layers}")
    if pp > 1 and layers == 0:
        raise BadInputError(f"pp={pp}: the model has no repeated layers to split into pipeline stages")
    if pp > layers > 0:
        raise BadInputError(f"pp={pp}: the model has only {layers} repeated layer{'s' * (layers > 1)} to split "
                            "into stages (stages are cut between alike layers, same ops and shapes, or between "
                            "groups of consecutive layers that repeat alike)")


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def microbatch_counts(batch: int | None, dp: int, constraints: Constraints) -> list[int]:
    """Microbatch counts m with every microbatch still split evenly over dp (batch % (m * dp) == 0),
    ascending; one count when ``microbatches`` or ``microbatch_size`` (per dp rank) is pinned."""
    if batch is None:
        return [1]
    if constraints.microbatch_size is not None:
        size = constraints.microbatch_size * dp
        return [batch // size] if batch % size == 0 else []
    fixed = constraints.microbatches
    if fixed is not None:
        return [] if batch % (fixed * dp) else [fixed]
    return [m for m in _divisors(batch // dp) if (batch // m) % dp == 0]


def global_batch(captured: CapturedGraph) -> int | None:
    """The step's samples (``core/batch.batch_size_of`` of its user inputs); None where no input has dims."""
    return batch_size_of([captured.node(name).meta["val"].shape for name in captured.user_inputs])


def batch_inputs(captured: CapturedGraph) -> set[str]:
    """The user inputs that carry the batch on dim 0 (``core/batch.batch_carriers``); the others are read whole."""
    carriers = batch_carriers([captured.node(name).meta["val"].shape for name in captured.user_inputs])
    return {name for name, carries in zip(captured.user_inputs, carriers) if carries}
