"""``shard(graph, n)``: split a graph into ``n`` exact partitions by KV-head group, plus the gathers that rebuild its outputs.

Query heads ``g*G .. g*G+G-1`` read only KV head ``g``, so shard ``s`` of ``n``
takes KV heads ``s*Hkv/n ..`` and their query heads, the matching rows of the
Q/K/V projections, the matching slice of a KV cache and the matching columns
of the output projection (tensor parallelism's column/row split).  Values on
a head axis (:mod:`graphc.sharding.axes`) are *split*; an einsum that
contracts a split axis away (the output projection) gives a *partial* value,
one addend per shard; everything else is *replicated*.

A node that needs a whole value (the residual add and MLP after an attention,
the next layer's norm) starts a new stage, so a plan is a list of stages that
alternate between *sharded* (``n`` graphs, one per shard) and *replicated*
(one graph).  A core, a layer or a KV-cache step is one sharded stage; a
decoder stack of ``L`` layers has ``2L`` stages.  Between stages the runner
moves values: split values stay on their shard when the next sharded stage
reads them; a replicated stage gets split values concatenated along their head
axis and partial values summed; a sharded stage gets whole values sent to
every shard.

A node without a sharding rule (an ONNX op graphc carries unmodelled) that touches a split value runs whole, in a
replicated stage of its own: its inputs are gathered from the shards, and a later sharded stage takes its result split
again.

Multi-query attention (one KV head) cannot be split by KV head; there the plan
splits the query heads and replicates K/V (each shard computes and keeps the
whole cache), and says so in :attr:`ShardPlan.fallback`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from graphc.attention_op import Attention
from graphc.dims import Dim, bind_shapes, dim_symbols, eval_dim, format_shape, normalize_dim
from graphc.errors import DimError, OpError, ShapeMismatchError, ShardingError
from graphc.graph import Graph, Node, op_dims
from graphc.ops import Einsum, Op, Repeat, Reshape, TensorType
from graphc.rotary import Positions
from graphc.tensor_ops import Slice

from .axes import AxisClasses, link_axes

__all__ = ["shard", "ShardPlan", "Stage", "sum_addends", "REPLICATED_MODES"]


@dataclass(frozen=True)
class Stage:
    """One step of a plan: ``graphs`` holds one graph per shard (sharded) or a single graph (replicated)."""

    index: int
    sharded: bool
    graphs: tuple[Graph, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ShardPlan:
    """The result of :func:`shard`: stages, and how every crossing value is split or rebuilt.

    ``split_axis[v]``: the head axis of a split value; ``partial``: values
    that are one addend per shard.
    """

    name: str
    n: int
    stages: tuple[Stage, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    split_axis: Mapping[str, int]
    partial: frozenset[str]
    fallback: str | None = None
    types: Mapping[str, TensorType] = field(default_factory=dict)
    assumptions: tuple[tuple[Dim, Dim], ...] = ()  # the source graph's (an imported model's domain), checked on every run

    def split(self, name: str, array: np.ndarray, shard: int) -> np.ndarray:
        """Shard ``shard``'s part of value ``name`` (the array itself when the value is not split)."""
        axis = self.split_axis.get(name)
        if axis is None:
            return array
        if array.shape[axis] % self.n:
            raise ShardingError(f"{name!r}: axis {axis} has {array.shape[axis]} entries, not a multiple of {self.n} shards")
        return _part(array, axis, shard, self.n)

    def gather(self, name: str, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The whole value ``name`` from its per-shard parts: concatenated (split), summed (partial) or shard 0's."""
        if name in self.split_axis:
            return np.concatenate(list(parts), axis=self.split_axis[name])
        if name in self.partial:
            return sum_addends(*parts)
        return parts[0]

    def __str__(self) -> str:
        lines = [f"shard plan for {self.name!r}: {self.n} shards, {len(self.stages)} stage(s)" + (f"; {self.fallback}" if self.fallback else "")]
        for st in self.stages:
            g = st.graphs[0]
            kind = f"sharded x{len(st.graphs)}" if st.sharded else "replicated"
            lines.append(
                f"  stage {st.index} ({kind}): {len(g.nodes)} node(s); in: {', '.join(st.inputs) or '-'}; out: {', '.join(st.outputs) or '-'}"
            )
        for name, axis in sorted(self.split_axis.items()):
            if name in self.inputs or name in self.outputs:
                lines.append(f"  {name}: split on axis {axis} {format_shape(self.types[name].shape)}")
        for name in sorted(self.partial & set(self.outputs)):
            lines.append(f"  {name}: summed over shards")
        return "\n".join(lines)


def sum_addends(*parts: np.ndarray) -> np.ndarray:
    """``parts[0] + parts[1] + ...`` in shard order, into a new array: every place that sums a partial value (the driver's gather, each
    shard's all-reduce) sums in the same order, so all of them hold the same numbers."""
    total = np.array(parts[0], copy=True)
    for p in parts[1:]:
        total += p
    return total


def _part(array: np.ndarray, axis: int, shard: int, n: int) -> np.ndarray:
    """Chunk ``shard`` of ``n`` contiguous chunks of ``array`` along ``axis`` (a copy)."""
    step = array.shape[axis] // n
    return np.take(array, np.arange(shard * step, (shard + 1) * step), axis=axis)


def _fused(graph: Graph) -> Graph:
    from graphc.optimizer import PassContext, PassManager, dead_code_elimination, fuse_attention
    from graphc.optimizer.legalize import simplify_views

    work = graph.copy()
    PassManager((fuse_attention, simplify_views, dead_code_elimination)).run(work, PassContext())
    return work


MLP_DOWN_WEIGHT = "mlp.down_proj.weight"
"""The name a decoder MLP's down projection ``[hidden, intermediate]`` ends with (transformers' and graphc's builders')."""


def _mlp_seeds(g: Graph, n: int) -> list[tuple[str, int]]:
    """Megatron's MLP split: the intermediate axis of every down projection (so of its up and gate projections, linked through the
    activation), when ``n`` divides it; the down projection then gives one addend per shard."""
    return [(name, 1) for name, arr in g.initializers.items() if name.endswith(MLP_DOWN_WEIGHT) and arr.ndim == 2 and arr.shape[1] % n == 0]


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def _seeds(g: Graph, n: int) -> tuple[list[tuple[str, int]], str | None]:
    seeds: list[tuple[str, int]] = []
    fallback = None
    attention = [node for node in g.topological_order() if isinstance(node.op, Attention)]
    if not attention:
        raise ShardingError(f"graph {g.name!r} has no attention graphc recognises: there are no heads to shard by")
    for node in attention:
        hq, hkv = g.types[node.inputs[0]].shape[1], g.types[node.inputs[1]].shape[1]
        if not isinstance(hq, int) or not isinstance(hkv, int):
            raise ShardingError(f"attention {node.name!r}: head counts must be fixed to shard, got {hq} query / {hkv} KV heads")
        if hkv % n == 0:
            seeds.append((node.inputs[1], 1))
        elif hkv == 1 and hq % n == 0:
            seeds.append((node.inputs[0], 1))
            fallback = f"multi-query attention: query heads split {n} ways, the single K/V head replicated on every shard"
        else:
            kv_ok = [d for d in _divisors(hkv) if d > 1]
            hint = f"shard counts that divide the {hkv} KV heads: {kv_ok}" if kv_ok else "it has no KV-head split"
            if hkv == 1:
                hint = f"multi-query attention splits its {hq} query heads instead: shard counts {[d for d in _divisors(hq) if d > 1]}"
            raise ShardingError(f"attention {node.name!r} ({hq} query / {hkv} KV heads) cannot be split into {n} shards; {hint}")
    return seeds, fallback


def _split_axes(g: Graph, classes: AxisClasses, seeds: list[tuple[str, int]], n: int) -> dict[str, int]:
    split: dict[str, int] = {}
    for root in {classes.find(s) for s in seeds}:
        for value, axis in classes.members(root):
            size = g.types[value].shape[axis]
            if not isinstance(size, int) or size % n:
                raise ShardingError(
                    f"value {value!r} {format_shape(g.types[value].shape)}: its head axis {axis} has size {size}, not a multiple of {n} shards"
                )
            if split.get(value, axis) != axis:
                raise ShardingError(
                    f"value {value!r} {format_shape(g.types[value].shape)} has head axes {split[value]} and {axis}; graphc splits one"
                )
            split[value] = axis
    return split


def _partials(g: Graph, split: Mapping[str, int], gathered: set[str]) -> set[str]:
    partial: set[str] = set()
    for node in g.topological_order():
        reads_split = [v for v in node.inputs if v in split]
        if node.name in gathered:
            continue  # no sharding rule: run whole, in a replicated stage
        if not reads_split or any(o in split for o in node.outputs):
            continue
        if isinstance(node.op, Einsum):
            partial.add(node.outputs[0])  # the split axis is contracted away: one addend per shard
        elif _reads_another_axis_length(g, node, split):
            continue  # token positions from a head-split value's sequence axis: the same on every shard
        elif not (isinstance(node.op, Attention) and len(node.outputs) > 1):
            raise ShardingError(
                f"node {node.name!r} ({node.op.kind}) reduces over the head axis of {reads_split[0]!r}; only einsums may (their results are summed)"
            )
    return partial


def _gathered(g: Graph, split: Mapping[str, int], classes: AxisClasses) -> set[str]:
    """Opaque nodes (no sharding rule: graphc does not know what they compute) that touch a head-split value: each runs
    whole in a replicated stage, on its inputs gathered from the shards; a later stage takes its result split again."""
    return {
        n.name
        for n in g.topological_order()
        if n.name in classes.opaque and any(v in split for v in (*n.inputs, *n.outputs)) and not _reads_another_axis_length(g, n, split)
    }


def _reads_another_axis_length(g: Graph, node: Node, split: Mapping[str, int]) -> bool:
    """``Positions`` reads only the length of one axis: of a head-split value, any axis but the head axis is whole on every shard."""
    if not isinstance(node.op, Positions):
        return False
    rank = g.types[node.inputs[0]].rank
    return split.get(node.inputs[0], -1) != node.op.axis % rank


def _stages(
    g: Graph, split: Mapping[str, int], partial: set[str], on_workers: bool, gathered: frozenset[str] | set[str] = frozenset()
) -> dict[str, int]:
    """Stage of every node: even stages are sharded, odd ones replicated (with ``on_workers`` only the ``gathered`` nodes
    are: every other node runs on the shards)."""
    produced: dict[str, int] = {v: 0 for v in g.inputs} | {v: 0 for v in g.initializers}
    stage_of: dict[str, int] = {}
    for node in g.topological_order():
        whole = node.name in gathered
        sharded = not whole and (on_workers or any(v in split for v in (*node.inputs, *node.outputs)) or any(o in partial for o in node.outputs))
        need = 0
        for v in node.inputs:
            s = produced[v]
            if v in g.initializers or v in g.inputs:  # available whole (or sliced by the runner) anywhere
                continue
            whole_needed = v in partial or (v in split and not sharded)
            need = max(need, s + 1 if whole_needed and s % 2 == 0 else s)
        stage = need + (need % 2) if sharded else need + 1 - (need % 2) if whole else need
        stage_of[node.name] = stage
        for o in node.outputs:
            produced[o] = stage
    _sink(g, stage_of, split, partial)
    return stage_of


def _sink(g: Graph, stage_of: dict[str, int], split: Mapping[str, int], partial: set[str]) -> None:
    """Move replicated nodes that only feed one later sharded stage into it (each shard computes them).

    Positions and norms of layer ``i + 1`` then sit with the attention that
    reads them, where the symbolic sizes they use (the cache length) are bound
    by that stage's inputs, and nothing extra crosses: the stage receives the
    node's inputs instead of its outputs.
    """
    for node in reversed(g.topological_order()):
        if any(v in split for v in (*node.inputs, *node.outputs)) or any(o in partial or o in g.outputs for o in node.outputs):
            continue
        consumers = {stage_of[c.name] for o in node.outputs for c in g.consumers(o)}
        if len(consumers) == 1:
            (target,) = consumers
            if target % 2 == 0 and target > stage_of[node.name]:
                stage_of[node.name] = target


def _shard_type(t: TensorType, axis: int | None, n: int) -> TensorType:
    if axis is None:
        return t
    shape = list(t.shape)
    shape[axis] = _split_size(shape[axis], n)
    return TensorType(tuple(shape), t.dtype)


def _split_size(d: Dim, n: int) -> int:
    """One shard's share of a split axis: a split axis is a static head count (the plan chose it for that)."""
    size = normalize_dim(d)
    if not isinstance(size, int):
        raise ShardingError(f"a split axis must have a static size, got {size!r}")
    return size // n


def _shard_op(g: Graph, node: Node, split: Mapping[str, int], n: int) -> Op:
    op = node.op
    out_axis = split.get(node.outputs[0])
    if isinstance(op, Reshape) and out_axis is not None:
        shape: list[Dim] = list(op.shape)
        shape[out_axis] = _split_size(shape[out_axis], n)
        return replace(op, shape=tuple(shape))
    rank = len(g.types[node.outputs[0]].shape)
    if isinstance(op, Slice) and (out_axis == op.axis % rank or split.get(node.inputs[0]) == op.axis % rank):
        raise ShardingError(f"node {node.name!r} slices along the head axis (a fused QKV projection); graphc cannot split it by KV-head group")
    if isinstance(op, Repeat) and out_axis is not None and out_axis == op.axis % rank and node.inputs[0] not in split:
        return replace(op, repeats=op.repeats // n)  # multi-query: the one KV head repeated for this shard's query heads only
    return op


def _stage_graph(
    g: Graph, name: str, nodes: list[Node], inputs: list[str], outputs: list[str], split: Mapping[str, int], n: int, shard: int | None
) -> Graph:
    sg = Graph(name)
    parts = n if shard is not None else 1
    for v in inputs:
        sg.add_input(v, _shard_type(g.types[v], split.get(v) if shard is not None else None, parts).shape, g.types[v].dtype)
    for node in nodes:
        for v in node.inputs:
            if v in g.initializers and v not in sg.initializers:
                arr = g.initializers[v]
                axis = split.get(v) if shard is not None else None
                if axis is not None and shard is not None:
                    arr = _part(arr, axis, shard, n)
                sg.add_initializer(v, arr, copy=axis is not None)
        op = _shard_op(g, node, split, n) if shard is not None else node.op
        try:
            got = sg.add_multi_node(op, node.inputs, node.outputs)
        except (ShapeMismatchError, OpError) as e:  # the head axis is merged into another (batch * heads) or sliced
            raise ShardingError(f"node {node.name!r} ({node.op.kind}) does not split by KV-head group on shard {shard}: {e}") from None
        for o, value in zip(node.outputs, got):
            want = _shard_type(g.types[o], split.get(o) if shard is not None else None, parts)
            if tuple(value.type.shape) != tuple(want.shape):
                raise ShardingError(
                    f"node {node.name!r}: shard {shard} infers {format_shape(value.type.shape)} for {o!r}, expected {format_shape(want.shape)}"
                )
    sg.output(*outputs)
    sg.verify()
    return sg


def _size_carriers(g: Graph, nodes: list[Node], ins: list[str]) -> list[str]:
    """Inputs of ``g`` to hand a stage as well, so that every size it uses can be read off its inputs' shapes.

    A stage may see a size only inside an expression it cannot solve (``batch*total_seq`` of a flattened mask, with
    no input carrying ``total_seq``); then the graph input that carries the symbol as a dim of its own goes in too
    (a mask or ids: small, and never split).  Solvability is tested with the run's own solver on made-up sizes."""
    symbols = sorted({s for n in g.inputs for d in g.types[n].shape for s in dim_symbols(d)})
    made_up = {s: 1009 + 37 * k for k, s in enumerate(symbols)}  # distinct, large: no expression of them is negative
    used = {s for v in ins for d in g.types[v].shape for s in dim_symbols(d)}
    used |= {s for node in nodes for o in node.outputs for d in g.types[o].shape for s in dim_symbols(d)}
    used |= {s for node in nodes for d in op_dims(node.op) for s in dim_symbols(d)}
    env: dict[str, int] = {}
    try:
        items = [(g.types[v].shape, [eval_dim(d, made_up) for d in g.types[v].shape], v) for v in ins]
        bind_shapes(items, env)
    except (DimError, KeyError):  # a size the graph's inputs do not define: _check_bound names it
        return []
    carriers = []
    for sym in sorted((used & made_up.keys()) - env.keys()):
        carrier = next((n for n in g.inputs if sym in {str(d) for d in g.types[n].shape} and n not in ins), None)
        if carrier is not None and carrier not in carriers:
            carriers.append(carrier)
    return carriers


def _check_bound(sg: Graph, stage: int) -> None:
    """Every symbolic size a stage uses must be bound by its inputs' shapes, or the stage cannot run alone."""
    bound = {sym for v in sg.inputs for d in sg.types[v].shape for sym in dim_symbols(d)}
    for node in sg.topological_order():
        used = {sym for o in node.outputs for d in sg.types[o].shape for sym in dim_symbols(d)}
        used |= {sym for d in op_dims(node.op) for sym in dim_symbols(d)}  # size-valued attributes: offsets, target shapes
        if used - bound:
            raise ShardingError(
                f"stage {stage}: node {node.name!r} uses sizes {sorted(used - bound)} that none of the stage's inputs "
                f"{list(sg.inputs)} carries; graphc cannot cut the graph there"
            )


REPLICATED_MODES = ("workers", "driver")
"""Where :func:`shard` puts the nodes that read no head-split value (norms, residual adds, embeddings, the LM head)."""


def shard(graph: Graph, n: int, mlp: bool = True, replicated: str = "workers") -> ShardPlan:
    """Split ``graph`` into ``n`` exact partitions by KV-head group (see the module doc); ``n`` must divide the KV heads.

    Attention is recognised first (the optimizer's ``fuse_attention``), so the
    shards hold ``Attention`` nodes; each shard graph can be optimized,
    exported and run on any backend.  Raises :class:`ShardingError` naming the
    attention and the valid shard counts when ``n`` does not divide.

    ``mlp``: also split every decoder MLP Megatron-style (gate/up by rows, down by columns: one addend per
    shard) where ``n`` divides its intermediate size.  ``replicated``: ``"workers"`` runs the nodes that read
    no split value (norms, residual adds, embeddings, the LM head) on every shard, so the residual stream
    stays there and a decoder layer is two sharded stages with one sum of addends after each; ``"driver"``
    runs them in replicated stages between the sharded ones.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ShardingError(f"shard count must be an int >= 1, got {n!r}")
    if replicated not in REPLICATED_MODES:
        raise ShardingError(f"replicated must be one of {REPLICATED_MODES}, got {replicated!r}")
    n = int(n)
    g = _fused(graph)
    seeds, fallback = _seeds(g, n)
    if mlp:
        seeds += _mlp_seeds(g, n)
    classes = link_axes(g)
    split = _split_axes(g, classes, seeds, n) if n > 1 else {}
    gathered = _gathered(g, split, classes)
    partial = _partials(g, split, gathered) if n > 1 else set()
    stage_of = _stages(g, split, partial, replicated == "workers", gathered)
    last = max(stage_of.values(), default=0)
    order = g.topological_order()
    stages = []
    for s in range(last + 1):
        nodes = [node for node in order if stage_of[node.name] == s]
        if not nodes:
            continue
        inside = {o for node in nodes for o in node.outputs}
        ins = list(dict.fromkeys(v for node in nodes for v in node.inputs if v not in inside and v not in g.initializers))
        ins += _size_carriers(g, nodes, ins)
        later = {v for node in order if stage_of[node.name] > s for v in node.inputs} | set(g.outputs)
        outs = [o for node in nodes for o in node.outputs if o in later]
        sharded = s % 2 == 0
        graphs = (
            tuple(_stage_graph(g, f"{g.name}.stage{s}.shard{i}", nodes, ins, outs, split, n, i) for i in range(n))
            if sharded
            else (_stage_graph(g, f"{g.name}.stage{s}", nodes, ins, outs, split, n, None),)
        )
        _check_bound(graphs[0], s)
        stages.append(Stage(s, sharded, graphs, tuple(ins), tuple(outs)))
    types = {v: g.types[v] for v in g.types}
    return ShardPlan(
        graph.name, n, tuple(stages), tuple(g.inputs), tuple(g.outputs), split, frozenset(partial), fallback, types, tuple(graph.assumptions)
    )
