"""What tf2onnx 1.17 lacks, or does slowly, for these graphs; `_convert` (`export/onnx.py`) uses it.

- `CUSTOM_OP_HANDLERS`: `XlaDynamicUpdateSlice` (the cache update, which
  tf2onnx has no handler for) as a `ScatterND`, and `SelectV2` as one `Where`;
- `_one_walk_subgraph_extraction` and `_optimize_in_place`: tf2onnx's pruning
  and optimizer loop without its repeated walks and bookkeeping (the same
  graphs, sooner).
"""

import contextlib

import numpy as np


def _dynamic_update_slice_handler(ctx, node, name, args):
    """tf2onnx handler for `XlaDynamicUpdateSlice`, as an ONNX ScatterND.

    `keras.ops.slice_update`, which writes each decoding step's key/value into
    the fixed-size self-attention cache, is `XlaDynamicUpdateSlice` on
    TensorFlow; tf2onnx 1.17 has no handler for it. This one gives it the
    XLA semantics exactly: `updates` is copied into `operand` at
    `start_indices`, each start clamped to `[0, operand_dim - update_dim]`.
    ScatterND copies values, so the exported step computes the same numbers
    as Keras (no export-only model code path is needed).

    The scatter indexes only the leading axes that need it: trailing axes
    where `updates` statically spans the whole operand (the heads and the
    per-head size of a cache update) have their start clamped to 0 anyway,
    so they are copied as whole slices. For a cache update `[B, 1, N, K]`
    into `[B, T, N, K]` the indices are `[B, 1, 2]`:

        indices[i_0, i_1] = (start_0 + i_0, start_1 + i_1)
        output = ScatterND(operand, indices, updates)

    which keeps the graph small (fewer nodes, each with ONNX Runtime's
    per-node overhead) and the cost proportional to the update, not to the
    cache.
    """
    from onnx import TensorProto
    from tf2onnx import utils

    operand, updates, start_indices = node.input
    rank = ctx.get_rank(operand)
    utils.make_sure(rank is not None, "XlaDynamicUpdateSlice %s needs an operand of known rank", name)
    operand_dims = ctx.get_shape(operand) or [-1] * rank
    update_dims = ctx.get_shape(updates) or [-1] * rank
    # Axes 0 .. depth - 1 get coordinates; the rest are whole slices.
    depth = 1
    for axis in range(rank):
        if not (operand_dims[axis] == update_dims[axis] and operand_dims[axis] not in (-1, None)):
            depth = axis + 1

    def const(value, label):
        return ctx.make_const(utils.make_name(f"{name}_{label}"), np.array(value, np.int64)).output[0]

    def leading(shape, label):
        return ctx.make_node("Slice", [shape, const([0], f"{label}_from"), const([depth], f"{label}_to")]).output[0]

    operand_shape = leading(ctx.make_node("Shape", [operand]).output[0], "operand")
    updates_shape = leading(ctx.make_node("Shape", [updates]).output[0], "updates")
    start = ctx.make_node("Cast", [start_indices], attr={"to": TensorProto.INT64}).output[0]
    start = ctx.make_node("Slice", [start, const([0], "start_from"), const([depth], "start_to")]).output[0]
    # XLA clamps the start so that the update lies inside the operand.
    room = ctx.make_node("Sub", [operand_shape, updates_shape]).output[0]
    start = ctx.make_node("Min", [start, room]).output[0]
    start = ctx.make_node("Max", [start, const([0] * depth, "zeros")]).output[0]
    index_shape = ctx.make_node("Concat", [updates_shape, const([1], "one")], attr={"axis": 0}).output[0]
    coordinates = []
    for axis in range(depth):
        axis_const = const(axis, f"axis{axis}")
        first = ctx.make_node("Gather", [start, axis_const]).output[0]  # scalar
        size = ctx.make_node("Gather", [updates_shape, axis_const]).output[0]  # scalar
        stop = ctx.make_node("Add", [first, size]).output[0]
        positions = ctx.make_node("Range", [first, stop, const(1, "step")]).output[0]  # [size]
        # [size] -> [1, .., size, .., 1, 1] -> updates.shape[:depth] + [1]
        broadcast_shape = [1] * (depth + 1)
        broadcast_shape[axis] = -1
        positions = ctx.make_node("Reshape", [positions, const(broadcast_shape, f"shape{axis}")]).output[0]
        coordinates.append(ctx.make_node("Expand", [positions, index_shape]).output[0])
    indices = coordinates[0] if depth == 1 else ctx.make_node("Concat", coordinates, attr={"axis": -1}).output[0]
    node.type = "ScatterND"
    ctx.replace_inputs(node, [operand, indices, updates])


def _select_handler(ctx, node, name, args):
    """tf2onnx handler for `SelectV2` (`keras.ops.where`), as one ONNX `Where`.

    tf2onnx 1.17 writes a select of non-NaN values as arithmetic,
    `Cast(c) * x + y * Cast(Not(c))` (five nodes; its comment: ONNX Runtime's
    `Where` was slow), on the search's `[B, K, V]` log-probabilities too.
    ONNX Runtime's `Where` is one node, and broadcasts as `SelectV2` does;
    the search's update graph (about a dozen selects per step) runs in
    fewer nodes and reads the vocabulary-sized tensors once instead of
    five times.
    """
    node.type = "Where"


CUSTOM_OP_HANDLERS = {
    "XlaDynamicUpdateSlice": (_dynamic_update_slice_handler, []),
    "SelectV2": (_select_handler, []),
}


def _extract_sub_graph_nodes(graph, outputs_name, input_checker=None, remove_unused_inputs=True):
    """tf2onnx's `Graph.extract_sub_graph_nodes` in one walk: the nodes the outputs `outputs_name` depend on.

    tf2onnx 1.17 walks the graph once per output (and per graph input with
    `remove_unused_inputs=False`), each walk listing a Loop's outer-scope
    inputs again: after every optimizer pass, `delete_unused_nodes` did
    about forty walks of a search's Loop body, a third of the conversion
    time of a whole-search graph. One walk with one visited set finds the
    same nodes (the union of the walks'), so the graph is the same.
    """
    outputs_to_keep = list(outputs_name)
    if not remove_unused_inputs:
        # tf2onnx keeps the placeholders that no output reads (a Loop body's inputs).
        outputs_to_keep += [placeholder.output[0] for placeholder in graph.inputs]

    def wanted(node):
        return node is not None and not (input_checker and input_checker(node) is False)

    found, pending = set(), [graph.get_node_by_output(name, search_in_parent_graphs=False) for name in outputs_to_keep]
    pending = [node for node in pending if wanted(node)]
    while pending:
        node = pending.pop()
        if node in found:
            continue
        found.add(node)
        # A node with a body (Loop, If) also reads the values its body takes from this graph.
        for name in node.input + list(node.get_implicit_inputs()):
            producer = graph.get_node_by_output(name, search_in_parent_graphs=False)
            if producer not in found and wanted(producer):
                pending.append(producer)
    return list(found)


@contextlib.contextmanager
def _one_walk_subgraph_extraction():
    """Within the block, tf2onnx's graphs find the nodes their outputs need with `_extract_sub_graph_nodes`."""
    from tf2onnx.graph import Graph

    original = Graph.extract_sub_graph_nodes
    Graph.extract_sub_graph_nodes = _extract_sub_graph_nodes
    try:
        yield
    finally:
        Graph.extract_sub_graph_nodes = original


def _optimize_in_place(graph, optimizers):
    """tf2onnx's `optimizer.optimize_graph(graph, catch_errors=False, optimizers=optimizers)`, with less bookkeeping.

    After every pass tf2onnx writes each node's ONNX proto again (for a
    Loop, its whole body, sorted and pruned) and prunes the unused nodes,
    whether or not the pass changed anything; most passes of a round change
    nothing, and this bookkeeping was a third of the conversion time of a
    whole-search graph. Here it runs after a pass only if the nodes, their
    inputs, outputs or attributes (in the bodies too: `_structure`) differ
    from when it last ran, so each pass sees the graph it would see in
    tf2onnx's loop, and the passes, their order and the rounds until none
    changes the graph are tf2onnx's.
    """
    from tf2onnx.optimizer.optimizer_base import GraphOptimizerBase

    synced = None  # `_structure(graph)` when the protos were last written and unused nodes pruned
    iteration, again = 0, True
    while again:
        again = False
        for factory in optimizers.values():
            optimizer = factory()
            if isinstance(optimizer, GraphOptimizerBase):
                optimizer.opt_iteration = iteration
                graph = optimizer._optimize(graph)
                if _structure(graph) != synced:
                    graph.update_proto()
                    graph.delete_unused_nodes(graph.outputs)
                    synced = _structure(graph)
            else:  # another kind of pass: tf2onnx's own call
                graph = optimizer.optimize(graph, iteration)
                synced = None
            again = again or optimizer.graph_been_opt
        iteration += 1
    graph.topological_sort(graph.get_nodes())
    return graph


def _structure(graph):
    """What tf2onnx's `update_proto` and `delete_unused_nodes` read of a graph: its nodes and outputs, and each body's."""
    from onnx import AttributeProto

    items = [tuple(graph.outputs)]
    for node in graph.get_nodes():
        bodies = node.get_body_graphs() or {}
        # Attributes by object (a pass sets a new one), strings by value (the einsum pass edits one in place).
        attributes = tuple(
            (name, id(value), value.s if value.type == AttributeProto.STRING else None)
            for name, value in node.attr.items() if name not in bodies
        )
        items.append((id(node), node.type, node.domain, tuple(node.input), tuple(node.output), attributes))
        items.extend((name, _structure(body)) for name, body in sorted(bodies.items()))
    return items
