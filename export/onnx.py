"""Export a TransformerModel to ONNX: `python -m export.onnx`.

The graphs of `export.contract.ONNX` (where their tensors, dtypes and axes
are listed), traced by `export/graphs.py`, which `export/runtime.py` serves:

- `encoder.onnx`, `init_cache.onnx` and `decoder_step.onnx`: the methods of
  the generation protocol (`keras_transformer.generation`),
  `TransformerModel.encode`, `init_cache` and `decode_step`. Caches are
  heads first: `[batch, L, N, T_max, K]`.
- `greedy_search.onnx` and `beam_search.onnx`: `generation.search_graph`,
  the lengths, the encoder, the cache and the search's
  `keras.ops.while_loop`, which tf2onnx converts into an ONNX `Loop` with
  the search state and the caches as loop-carried values. One
  `session.run` translates a batch, with the search's own code (the tokens
  are Keras'); the beam size is an input, so one graph serves every beam.
  `beam_hypotheses.onnx` and `sample_search.onnx`: the same for
  `generate_hypotheses` (n-best, target prefixes, sampling).
- `fused_decoder_step.onnx`: the decoder step built for ONNX Runtime from
  the model's weights (`export/fused_step.py`: fused contrib ops, the
  self-attention cache written in place, the cross-attention cache once per
  source; int8 with `--quantize int8`), checked against `decode_step` at
  validation. With `beam_start.onnx` / `beam_update.onnx`,
  `sample_start.onnx` / `sample_update.onnx` and `greedy_update.onnx`
  (greedy search starts as sampling): `generation.start_graph` and
  `update_graph`, the same searches one update per call, for
  `export/steps.py`'s driver (rows that are done leave the batch; the cache
  grows with the output). Only for the models the fused step covers
  (post-LN, float32; others keep the whole-search graphs, with a warning).

After conversion each graph is made leaner (`_convert`): values the Loop
only carries along (the weights) become outer-scope initializers, Keras'
tensordot reshapes around matrix products are folded, and TensorFlow's
13-node layer norm becomes ONNX's `LayerNormalization`; every graph's
large tensors are then stored once, in `weights.bin` (`_share_weights`).

Why `init_cache` is its own graph rather than extra outputs of the encoder:
in the protocol, `init_cache` is a function of `encoder_outputs` and the
source ids, not a by-product of `encode`. Folded into the encoder graph, the
runtime would have to remember what `encode` returned and hand it out again
from `init_cache`, which is wrong as soon as a caller passes other encoder
outputs (tiled per beam, reordered, or computed elsewhere). Exporting
`init_cache` itself keeps one definition of the cache layout (`model.py`),
computes the cross-attention keys/values once per source, and lets ONNX
Runtime allocate the zero self-attention cache where it is used (on the GPU
under CUDA). The updated caches are named `updated_self_key` and
`updated_self_value` because an ONNX graph cannot reuse an input's name for
an output.

The directory is self-contained: the graphs, `weights.bin`, `config.json`
(ids, sizes, opset, exporting versions, format name and version) and the
tokenizer when the preset has one (ours, or an imported Marian checkpoint's
files: `export.runtime.OnnxTranslator` reads either). It is written next to its final place and renamed at the end, so a
failed export (conversion or validation) leaves nothing behind.

Example:

```
python -m export.onnx --preset path/to/preset --output exported/onnx
python -m export.onnx --preset path/to/preset --output exported/onnx-int8 --quantize int8 --from-float32 exported/onnx
python -m export.onnx --preset tiny --output exported/tiny-int8 --quantize int8
```

`--from-float32` quantizes the graphs of an existing float32 export of the
same preset rather than converting the model again (the conversion is most
of an export's time); the export is checked to be the preset's first.
"""

import argparse
import contextlib
import json
import logging
import os
import pathlib
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

import numpy as np  # noqa: E402

from export import contract  # noqa: E402
from export.fused_step import NotFusable, build_fused_step, fused_step_weights  # noqa: E402
from export.graphs import graph_functions  # noqa: E402
from export.validate import QUANTIZATIONS, validate_onnx  # noqa: E402
from keras_transformer.utils import atomic_directory, check_output_directory  # noqa: E402
from keras_transformer.quantization import refuse_quantized  # noqa: E402

# Named, not __name__, so that `python -m export.onnx` logs under the same name.
logger = logging.getLogger("export.onnx")

# Opset 17: the first with ONNX's LayerNormalization, which
# `_fuse_layer_norms` puts in place of TensorFlow's 13-node decomposition
# (ONNX Runtime >= 1.14 runs it). The graphs need opset 12 at least (Range and
# ScatterND for the cache update below, int64 Min/Max); tf2onnx 1.17 emits the
# same nodes at every opset from 13 to 17 (18 swaps the layer-norm
# GlobalAveragePools for ReduceMeans, which the fusion also matches).
# `--opset` picks another within tf2onnx's tested range (14-18); below 17 the
# layer norms stay unfused.
DEFAULT_OPSET = 17
MIN_OPSET = 14
MAX_OPSET = 18  # The newest opset tf2onnx 1.17 knows.


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


def _optimizers():
    """tf2onnx's optimizers without the pass that miscompiles attention (`keras_export.tf2onnx_optimizers`)."""
    from keras_transformer.keras_export import tf2onnx_optimizers

    return tf2onnx_optimizers()


def _convert(function, input_signature, opset, path):
    """Converts one tf.function with tf2onnx and writes it to `path`.

    The steps of `tf2onnx.convert.from_function`, with four changes: an
    op tf2onnx cannot convert is an error (tf2onnx logs it and leaves it in
    the graph), the optimizer list of `_optimizers()` (run by
    `_optimize_in_place`), unused nodes found in one walk
    (`_extract_sub_graph_nodes`), and
    `_fold_tensordot_reshapes` afterwards.
    """
    import onnx
    import tensorflow as tf
    from tf2onnx import convert, optimizer, tf_loader, tfonnx

    # No autograph: the functions are keras.ops and explicit tf.cond/while
    # (its source transformation cost 10-15 s per export process).
    concrete = tf.function(function, autograph=False).get_concrete_function(*input_signature)
    input_names = [t.name for t in concrete.inputs if t.dtype != tf.resource]
    output_names = [t.name for t in concrete.outputs if t.dtype != tf.resource]
    # Graph inputs and outputs take the names of the TensorSpecs and of the
    # returned dict's keys.
    renames = convert.tensor_names_from_structed(concrete, input_names, output_names)
    with tf.device("/cpu:0"):
        graph_def = tf_loader.from_function(concrete, input_names, output_names)
    with tf.Graph().as_default() as tf_graph, _one_walk_subgraph_extraction():
        tf.import_graph_def(graph_def, name="")

        def onnx_graph():
            try:
                return tfonnx.process_tf_graph(
                    tf_graph,
                    continue_on_error=False,
                    opset=opset,
                    custom_op_handlers=dict(CUSTOM_OP_HANDLERS),
                    input_names=input_names,
                    output_names=output_names,
                    tensors_to_rename=renames,
                )
            except Exception as error:
                raise RuntimeError(f"tf2onnx could not convert {path.name} at opset {opset}: {error}") from error

        # With catch_errors, tf2onnx deep-copies the whole graph before each
        # optimizer pass, to restore it if the pass fails: a third of the
        # conversion time of a search graph. The passes run in place first;
        # only if one fails is the graph converted again and optimized the
        # careful way (the same result where no pass fails).
        graph = onnx_graph()
        try:
            graph = _optimize_in_place(graph, _optimizers())
        except Exception:  # a tf2onnx optimizer pass failed on this graph
            logger.debug("tf2onnx optimizer failed in place on %s; optimizing a fresh copy pass by pass", path.name)
            graph = optimizer.optimize_graph(onnx_graph(), catch_errors=True, optimizers=_optimizers())
        model_proto = graph.make_model(f"keras_transformer {path.stem}")
    _hoist_loop_invariants(model_proto.graph)
    for subgraph in _graphs(model_proto.graph):
        _fold_tensordot_reshapes(subgraph)
        _drop_negative_index_fixes(subgraph)
    _remove_dead_nodes(model_proto.graph)
    _drop_no_op_pairs(model_proto)
    _fold_constants(model_proto)
    if opset >= 17:  # ONNX's LayerNormalization
        _fuse_layer_norms(model_proto)
    _remove_unused_initializers(model_proto.graph)
    # tf2onnx logs the TensorFlow ops it has no handler for and leaves them in
    # the graph; fail here, naming them, rather than when a runtime loads it.
    unconverted = sorted(
        {node.op_type for node in model_proto.graph.node if not onnx.defs.has(node.op_type, node.domain or "")}
    )
    if unconverted:
        raise RuntimeError(
            f"tf2onnx could not convert the TensorFlow op(s) {unconverted} of {path.name} at opset {opset}"
        )
    onnx.checker.check_model(model_proto)
    onnx.save(model_proto, str(path))


def _fold_tensordot_reshapes(graph):
    """Rewrites Keras' `Dense` on `[B, T, D]` inputs as one broadcasting ONNX MatMul.

    Keras' TensorFlow `matmul` of a rank-3 input and a rank-2 kernel is
    `tf.tensordot`: reshape to `[B * T, D]` (with the shape computed from
    `tf.shape` at run time), MatMul, reshape back to `[B, T, E]`. ONNX MatMul
    broadcasts `[B, T, D] x [D, E]` itself, so `Reshape -> MatMul -> Reshape`
    becomes the MatMul alone, and the shape arithmetic around it (about ten
    nodes per projection) is dropped: the `small` preset's decoder step went
    from 694 to 555 nodes, each of which ONNX Runtime runs with its own
    overhead; the values are the same products (validation compares them
    with Keras).

    Matches tf2onnx's names for the three ops of a `tf.tensordot` whose
    product is only reshaped back; anything else is left alone.
    """
    producers = {output: node for node in graph.node for output in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {output.name for output in graph.output}
    removed = []
    for node in graph.node:
        if node.op_type != "MatMul" or not node.output[0].endswith("/Tensordot/MatMul:0"):
            continue
        flatten = producers.get(node.input[0])
        after = consumers.get(node.output[0], [])
        if (
            flatten is None
            or flatten.op_type != "Reshape"
            or not flatten.output[0].endswith("/Tensordot/Reshape:0")
            or len(after) != 1
            or after[0].op_type != "Reshape"
            # Its shape is the tensordot's (its output may be renamed, as a graph output).
            or "/Tensordot" not in after[0].input[1]
            or node.output[0] in outputs
        ):
            continue
        node.input[0] = flatten.input[0]
        node.output[0] = after[0].output[0]
        removed.append(after[0])
    for node in removed:
        graph.node.remove(node)
    return len(removed)


def _drop_negative_index_fixes(graph):
    """Feeds each `Gather` its indices without Keras' negative-index fix.

    Keras' TensorFlow `take` is `tf.gather(x, where(i < 0, i + dim, i))`
    (TensorFlow's gather refuses negative indices); ONNX's `Gather` takes
    indices in `[-dim, dim - 1]` and reads a negative one from the end, the
    same rule, so the fix (a `Where`, an `Add`, a `Less` and the shape
    arithmetic of `dim`: about ten nodes per `take`) is dropped where it
    matches exactly: `Gather(x, Where(Less(i or Cast(i), 0), Add(i, _), i))`.
    `_remove_dead_nodes` then removes what only the fix used.

    Returns:
        int, the number of gathers rewired.
    """
    from onnx import numpy_helper

    producers = {output: node for node in graph.node for output in node.output}
    # Scalar zeros only: the weights are not read.
    zeros = {
        tensor.name for tensor in graph.initializer
        if np.prod(tensor.dims, dtype=np.int64) == 1 and numpy_helper.to_array(tensor).reshape(()) == 0
    }
    rewired = 0
    for node in graph.node:
        if node.op_type != "Gather":
            continue
        select = producers.get(node.input[1])
        if select is None or select.op_type != "Where":
            continue
        condition, shifted, indices = (producers.get(select.input[0]), producers.get(select.input[1]),
                                       select.input[2])
        if condition is None or condition.op_type != "Less" or condition.input[1] not in zeros:
            continue
        compared = producers.get(condition.input[0])
        if condition.input[0] != indices and not (
            compared is not None and compared.op_type == "Cast" and compared.input[0] == indices
        ):
            continue
        if shifted is None or shifted.op_type != "Add" or indices not in shifted.input:
            continue
        node.input[1] = indices
        rewired += 1
    return rewired


def _copy(message):
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


def _graphs(graph):
    """`graph` and, depth first, every subgraph of its nodes (a Loop's body)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                yield from _graphs(attribute.g)


def _remove_dead_nodes(graph):
    """Drops nodes none of whose outputs is used, in `graph` and its subgraphs.

    A value is used when it is an output of its graph or an input of a node
    in that graph or in any subgraph below it (subgraphs read outer values
    by name).
    """
    for subgraph in _graphs(graph):
        if subgraph is not graph:
            _remove_dead_nodes(subgraph)
    while True:
        used = {output.name for output in graph.output}
        used.update(name for inner in _graphs(graph) for node in inner.node for name in node.input)
        dead = [node for node in graph.node if not any(output in used for output in node.output)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def _drop_no_op_pairs(model_proto):
    """Drops what tf2onnx's conversion leaves that computes nothing, in every graph; returns the count.

    - `Squeeze(Unsqueeze(x, axes), axes)` is x: greedy search's hypotheses get
      a beam axis of 1 that its update graph squeezes off again;
    - `Not(Not(x))` is x: tf2onnx converts `all` to a negated `any`, which
      the search negates;
    - `Less` / `Greater` of two integer tensors of one type, each cast to
      float: tf2onnx 1.17 converts them for opset 7 (float only) at every
      opset; ONNX compares integers since opset 9, and the same way for
      values below 2**24 (ids, lengths, positions).

    The Squeeze or the outer Not becomes an `Identity` of x (ONNX Runtime
    removes it when it loads the graph, unless it gives a graph output); the
    nodes no longer read go with `_remove_dead_nodes`. One node costs about
    0.5 us per run in ONNX Runtime on one thread: an update graph runs once
    per decoder step.
    """
    import onnx
    from onnx import TensorProto

    try:
        typed = onnx.shape_inference.infer_shapes(model_proto)
    except Exception:  # noqa: BLE001 - without types, the comparisons stay as they are
        typed = model_proto
    types = {}
    for graph in _graphs(typed.graph):
        for info in (*graph.input, *graph.value_info, *graph.output):
            types[info.name] = info.type.tensor_type.elem_type
        types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    constants = {tensor.name: tensor for graph in _graphs(model_proto.graph) for tensor in graph.initializer}
    integers, floats = {TensorProto.INT32, TensorProto.INT64}, {TensorProto.FLOAT, TensorProto.DOUBLE}
    dropped = 0
    for graph in _graphs(model_proto.graph):
        producers = {output: node for node in graph.node for output in node.output}
        for node in graph.node:
            sources = [producers.get(name) for name in node.input]
            if node.op_type in ("Less", "Greater"):
                if all(cast is not None and cast.op_type == "Cast" and _attribute(cast, "to") in floats
                       for cast in sources):
                    original = {types.get(cast.input[0]) for cast in sources}
                    if len(original) == 1 and original <= integers:
                        node.input[:] = [cast.input[0] for cast in sources]
                        dropped += 1
                continue
            source = sources[0] if sources else None
            undone = source is not None and (
                (node.op_type == "Not" and source.op_type == "Not")
                or (node.op_type == "Squeeze" and source.op_type == "Unsqueeze" and len(node.input) == 2
                    and len(source.input) == 2 and _same_constant(node.input[1], source.input[1], constants))
            )
            if undone:
                x = source.input[0]
                node.op_type, node.domain = "Identity", ""
                del node.input[:], node.attribute[:]
                node.input.append(x)
                dropped += 1
    _remove_dead_nodes(model_proto.graph)
    return dropped


def _same_constant(first, second, constants):
    """Whether two value names are one value or two initializers of the same contents."""
    from onnx import numpy_helper

    if first == second:
        return True
    if first not in constants or second not in constants:
        return False
    a, b = (numpy_helper.to_array(constants[name]) for name in (first, second))
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def _attribute(node, name):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _fold_constants(model_proto):
    """Computes Reshape and Transpose nodes of initializers ahead of time, in every graph.

    Once `_hoist_loop_invariants` has made the Loop body read the weights
    from the outer graph, tf2onnx's reshapes of LayerNorm scales and the
    transposed embedding matrix of the output projection are functions of
    constants only; as initializers they can be fused, pre-packed and
    quantized like the others.

    Returns:
        int, the number of nodes folded.
    """
    from onnx import numpy_helper

    top = model_proto.graph
    initializers = {tensor.name: tensor for tensor in top.initializer}
    folded = 0
    for graph in _graphs(top):
        initializers.update({tensor.name: tensor for tensor in graph.initializer})
        for node in list(graph.node):
            if node.op_type not in ("Reshape", "Transpose") or not all(name in initializers for name in node.input):
                continue
            value = numpy_helper.to_array(initializers[node.input[0]])
            if node.op_type == "Reshape":
                shape = numpy_helper.to_array(initializers[node.input[1]]).astype(np.int64)
                shape = [value.shape[i] if size == 0 else size for i, size in enumerate(shape)]
                value = value.reshape(shape)
            else:
                permutation = _attribute(node, "perm")
                value = np.transpose(value, permutation)
            tensor = numpy_helper.from_array(np.ascontiguousarray(value), node.output[0])
            top.initializer.append(tensor)
            initializers[tensor.name] = tensor
            graph.node.remove(node)
            folded += 1
    return folded


def _fuse_layer_norms(model_proto):
    """Rewrites Keras' LayerNormalization, as tf2onnx converts it, into one ONNX op.

    TensorFlow computes a layer norm as `tf.nn.moments` and a batch-norm
    formula: 13 ONNX nodes (two means, a squared difference, a reciprocal
    square root, three products and three sums), each run by ONNX Runtime
    with its own overhead. ONNX's `LayerNormalization` (opset 17) computes
    the same `(x - mean) / sqrt(var + epsilon) * gamma + beta` over the last
    axis in one kernel. Matched by tf2onnx's node names under a layer-norm
    scope (`.../moments/mean` and its siblings) and checked op by op and
    edge by edge; anything else is left as it was. The graphs are
    validated against Keras afterwards, as always.

    Returns:
        int, the number of layer norms fused (in the graph and its subgraphs).
    """
    from onnx import helper, numpy_helper

    initializers = {tensor.name: tensor for tensor in model_proto.graph.initializer}
    fused = 0
    for graph in _graphs(model_proto.graph):
        initializers.update({tensor.name: tensor for tensor in graph.initializer})
        by_name = {node.name: node for node in graph.node}
        replaced = []
        for mean in list(graph.node):
            if mean.op_type not in ("GlobalAveragePool", "ReduceMean") or not mean.name.endswith("/moments/mean"):
                continue
            scope = mean.name[: -len("/moments/mean")]
            nodes = {suffix: by_name.get(f"{scope}/{suffix}") for suffix in (
                "moments/SquaredDifference", "moments/variance", "add", "Rsqrt", "mul", "mul_1", "mul_2",
                "Neg", "add_1", "add_2",
            )}
            # tf2onnx drops `+ beta` when beta is a constant zero (a fresh model):
            # then add_2 adds the two products directly.
            no_beta = nodes["add_1"] is None
            if no_beta:
                nodes["add_1"] = nodes["mul_1"]
            if any(node is None for node in nodes.values()):
                continue
            x, mean_out = mean.input[0], mean.output[0]
            difference, epsilon_add = nodes["moments/SquaredDifference"], nodes["add"]
            expected = (
                (difference, "Sub", [x, mean_out]),
                (nodes["Neg"], "Neg", [mean_out]),
                (nodes["mul_2"], "Mul", [x, nodes["mul"].output[0]]),
                (nodes["mul_1"], "Mul", [nodes["Neg"].output[0], nodes["mul"].output[0]]),
                (nodes["add_2"], "Add", [nodes["mul_2"].output[0], nodes["add_1"].output[0]]),
                (nodes["add_1"], "Mul" if no_beta else "Add", [None, None] if no_beta else [nodes["mul_1"].output[0], None]),
                (nodes["mul"], "Mul", [None, None]),
                (epsilon_add, "Add", [nodes["moments/variance"].output[0], None]),
            )
            if any(
                node.op_type != op_type or len(node.input) != len(inputs)
                or any(want is not None and got != want for got, want in zip(node.input, inputs))
                for node, op_type, inputs in expected
            ):
                continue
            gamma = [name for name in nodes["mul"].input if name in initializers]
            beta = [] if no_beta else [nodes["add_1"].input[1]]
            tensors = [initializers.get(name) for name in (*gamma, epsilon_add.input[1], *beta)]
            if len(gamma) != 1 or any(tensor is None for tensor in tensors):
                continue
            gamma_value, epsilon, *beta_value = (numpy_helper.to_array(tensor) for tensor in tensors)
            beta_value = np.zeros_like(gamma_value) if no_beta else beta_value[0]
            if gamma_value.size != beta_value.size or epsilon.size != 1:
                continue
            names = []
            for label, value in (("gamma", gamma_value), ("beta", beta_value)):
                name = f"{scope}/LayerNormalization/{label}"
                model_proto.graph.initializer.append(numpy_helper.from_array(value.reshape(-1), name))
                names.append(name)
            layer_norm = helper.make_node(
                "LayerNormalization", [x, *names], [nodes["add_2"].output[0]],
                name=f"{scope}/LayerNormalization", axis=-1, epsilon=float(epsilon.reshape(())),
            )
            replaced.append((nodes["add_2"], layer_norm))
        for old, new in replaced:
            position = list(graph.node).index(old)
            graph.node.remove(old)
            graph.node.insert(position, new)
        fused += len(replaced)
    if fused:
        _remove_dead_nodes(model_proto.graph)
    return fused


def _remove_unused_initializers(graph):
    """Drops initializers that no node of their graph or its subgraphs reads, at every depth."""
    for inner in _graphs(graph):
        used = {name for deeper in _graphs(inner) for node in deeper.node for name in node.input}
        used.update(output.name for output in inner.output)
        for tensor in [tensor for tensor in inner.initializer if tensor.name not in used]:
            inner.initializer.remove(tensor)


def _hoist_loop_invariants(graph):
    """Turns the values a `Loop` only carries along into outer-scope references.

    tf2onnx converts every value a TensorFlow while loop reads (the model's
    weights, the search's lengths and alpha) into a loop-carried variable
    that the body passes through unchanged. ONNX lets a body read outer
    values by name instead; then the weights are initializers, which ONNX
    Runtime pre-packs for its matrix products and the int8 quantizer can
    quantize, and nothing is handed from one iteration to the next (the
    `small` preset's beam search ran about 10-20% faster with this alone).

    Returns:
        int, the number of loop-carried variables removed.
    """
    removed = 0
    for node in graph.node:
        if node.op_type != "Loop":
            continue
        body = next(attribute.g for attribute in node.attribute if attribute.name == "body")
        carried = len(node.input) - 2  # Loop inputs: trip count, condition, carried values.
        invariant = {}  # body input name -> outer value name
        for j in range(carried):
            inner, outer = body.input[2 + j].name, node.input[2 + j]
            if outer and body.output[1 + j].name == inner:
                invariant[j] = (inner, outer)
        if not invariant:
            continue
        # After the loop, its final value of an invariant is the initial one.
        finals = {node.output[j]: outer for j, (_, outer) in invariant.items()}
        if any(output.name in finals for output in graph.output):
            continue
        for other in graph.node:
            for i, name in enumerate(other.input):
                if name in finals:
                    other.input[i] = finals[name]
        inner_to_outer = dict(invariant.values())
        for subgraph in _graphs(body):
            for inner_node in subgraph.node:
                for i, name in enumerate(inner_node.input):
                    if name in inner_to_outer:
                        inner_node.input[i] = inner_to_outer[name]
        kept = [j for j in range(carried) if j not in invariant]
        body_inputs = list(body.input[:2]) + [body.input[2 + j] for j in kept]
        body_outputs = [body.output[0]] + [body.output[1 + j] for j in kept] + list(body.output[1 + carried:])
        loop_inputs = list(node.input[:2]) + [node.input[2 + j] for j in kept]
        loop_outputs = [node.output[j] for j in kept] + list(node.output[carried:])
        for container, values in (
            (body.input, body_inputs), (body.output, body_outputs), (node.input, loop_inputs), (node.output, loop_outputs)
        ):
            values = [value if isinstance(value, str) else _copy(value) for value in values]
            del container[:]
            container.extend(values)
        removed += len(invariant)
    return removed


def _quantize_int8(path):
    """ONNX Runtime dynamic quantization of `path`, in place.

    Weights int8 (per tensor), activations quantized at run time from their
    observed range: MatMuls become MatMulInteger, and the embedding Gather
    reads 8-bit weights through a DequantizeLinear. Without the
    `quant_pre_process` that ONNX Runtime suggests in a warning: its
    symbolic shape inference cannot follow these graphs' shape arithmetic.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    float_path = path.with_name(path.stem + ".float32.onnx")
    model_proto = onnx.load(str(path))
    _copy_outer_weights_into_loops(model_proto)
    onnx.save(model_proto, str(float_path))
    path.unlink()
    # EnableSubgraph: also the matrix products inside the search's Loop body.
    quantize_dynamic(
        str(float_path), str(path), weight_type=QuantType.QInt8, extra_options={"EnableSubgraph": True}
    )
    float_path.unlink()


def _copy_outer_weights_into_loops(model_proto):
    """Gives each Loop body its own copy of the outer initializers it reads.

    ONNX Runtime's quantizer only quantizes a subgraph's matrix products
    whose weights are initializers of that subgraph; after
    `_hoist_loop_invariants` the decoder inside the search's Loop reads them
    from the outer graph, and would stay float32. The copies are renamed
    (ONNX names are unique across scopes); `_share_weights` stores equal
    bytes once.
    """
    from onnx import numpy_helper

    outer = {tensor.name: tensor for tensor in model_proto.graph.initializer}
    for node in model_proto.graph.node:
        if node.op_type != "Loop":
            continue
        body = next(attribute.g for attribute in node.attribute if attribute.name == "body")
        read = {name for inner in _graphs(body) for n in inner.node for name in n.input if name in outer}
        renamed = {name: f"{name}/in_loop" for name in read}
        for name in sorted(read):
            body.initializer.append(numpy_helper.from_array(numpy_helper.to_array(outer[name]), renamed[name]))
        for inner in _graphs(body):
            for n in inner.node:
                for i, name in enumerate(n.input):
                    if name in renamed:
                        n.input[i] = renamed[name]
    _remove_unused_initializers(model_proto.graph)


# Every graph holds the weights it uses (the search graphs hold the whole
# model); they are stored once, in this file beside the graphs.
WEIGHTS_FILE = "weights.bin"
# Smaller tensors (shapes, scalars) stay inside their graph.
_SHARED_MIN_BYTES = 1024


def _share_weights(directory, paths):
    """Moves the graphs' large initializers into one file, each distinct tensor once.

    ONNX external data: a tensor records a file, offset and length instead of
    its bytes. Five graphs that each hold the model's weights (the protocol
    graphs and the two whole-search graphs) then take the disk space of one
    copy. Offsets are 64-byte aligned so that ONNX Runtime can map them.
    """
    import hashlib

    import onnx
    from onnx.external_data_helper import set_external_data

    offsets = {}  # (dtype, dims, sha256) -> (offset, length)
    with open(directory / WEIGHTS_FILE, "wb") as weights:
        for path in paths:
            model_proto = onnx.load(str(path))
            for graph in _graphs(model_proto.graph):
                for tensor in graph.initializer:
                    if not tensor.HasField("raw_data") or len(tensor.raw_data) < _SHARED_MIN_BYTES:
                        continue
                    data = tensor.raw_data
                    key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).hexdigest())
                    if key not in offsets:
                        weights.write(b"\0" * (-weights.tell() % 64))
                        offsets[key] = (weights.tell(), len(data))
                        weights.write(data)
                    offset, length = offsets[key]
                    set_external_data(tensor, WEIGHTS_FILE, offset=offset, length=length)
                    tensor.ClearField("raw_data")
            onnx.save(model_proto, str(path))
    return len(offsets)


def _config(model, files, opset, quantize):
    """config.json: the format, the graph files, the model's ids and sizes, the exporting versions."""
    return {
        **contract.ONNX.header(),
        "graphs": files,
        "weights": WEIGHTS_FILE,
        "opset": opset,
        "quantization": quantize,
        **contract.model_fields(model),
        # onnxruntime is only needed to quantize and validate.
        "versions": contract.versions("tensorflow", "tf2onnx", "onnx", optional=("onnxruntime",)),
    }


def _load_model(preset):
    import keras

    from keras_transformer.lora import merged_model
    from keras_transformer.model import TransformerModel

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "ONNX export runs on the TensorFlow backend (tf2onnx converts "
            f"TensorFlow graphs); KERAS_BACKEND is {keras.backend.backend()!r}. "
            "Run with KERAS_BACKEND=tensorflow."
        )
    if isinstance(preset, TransformerModel):
        model = merged_model(preset)  # LoRA adapters merged into the kernels
    else:
        # Dropout is inactive at inference; 0.0 keeps it out of the traced graphs.
        model = TransformerModel.from_preset(preset, dropout=0.0)
    contract.check_exportable(model, "ONNX")
    return model


def _reusable_graphs(directory, model, opset, names, atol):
    """The graph files of `names` in the float32 export `directory` of `model` at `opset` (checked)."""
    from export.validate import check_float32_export

    directory = pathlib.Path(directory)
    check_float32_export(directory, model, atol=atol)
    config = json.loads((directory / contract.CONFIG_FILE).read_text())
    if config.get("opset") != opset:
        raise ValueError(
            f"{directory} was exported at opset {config.get('opset')}; opset={opset} was asked for "
            f"(pass --opset {config.get('opset')})"
        )
    missing = [name for name in names if name not in config["graphs"]]
    if missing:
        raise ValueError(f"{directory} lacks the graphs {missing}; export the model again without float32_export")
    return {name: directory / config["graphs"][name] for name in names}


def _inline_weights(source, path):
    """Writes the graph `source` to `path` with its weights inside it (they are in `WEIGHTS_FILE` beside `source`).

    The graph as `_convert` wrote it before `_share_weights` moved the
    weights out: the same tensors, with no external-data fields.
    """
    import onnx

    model_proto = onnx.load(str(source))  # reads the weights beside it
    for graph in _graphs(model_proto.graph):
        for tensor in graph.initializer:
            tensor.ClearField("data_location")
    onnx.save(model_proto, str(path))


def is_onnx_export(directory):
    """Whether a directory is an export of `export_onnx`, of any format version (the oldest had no "format")."""
    directory = pathlib.Path(directory)
    oldest = (directory / contract.CONFIG_FILE).is_file() and any(directory.glob("*.onnx"))
    return contract.is_export_of(contract.ONNX)(directory) or oldest


def check_output(output, overwrite, preset=None, flag="overwrite=True (--overwrite)"):
    """`utils.check_output_directory` for an ONNX export: only an earlier ONNX export is replaced."""
    return check_output_directory(
        output, overwrite, is_onnx_export, "an ONNX export (python -m export.onnx)", source=preset, flag=flag
    )


def export_onnx(preset, output, opset=DEFAULT_OPSET, quantize=None, overwrite=False, atol=1e-4, float32_export=None,
                with_tokenizer=False):
    """Exports a TransformerModel to an ONNX Runtime directory and validates it.

    Args:
        preset: a built-in preset name, a preset directory (from
            `save_to_preset`), a Marian checkpoint directory or `hf://`
            handle (imported by `TransformerModel.from_preset`), or a
            `TransformerModel`.
        output: directory to create.
        opset: int, ONNX opset in `[14, 18]`. Defaults to 17 (see
            `DEFAULT_OPSET`).
        quantize: `None` (float32) or `"int8"` (ONNX Runtime dynamic
            quantization of the weights; checked for names and shapes, its
            accuracy is measured with BLEU, not a tolerance).
        overwrite: bool, replace an existing `output`.
        atol: float, tolerance of the float32 graphs against Keras.
        float32_export: with `quantize="int8"`, a float32 export of the
            same model (this function's output without `quantize`) whose
            graphs are quantized instead of converted again (the tf2onnx
            conversion is most of an export's time). Checked first
            (`export.validate.check_float32_export`): its config, opset and
            graphs, and the values of its encoder and decoder step.
        with_tokenizer: bool, also write `translate.onnx` (text in, text
            out; `export.text_graph.write_text_graph`, validated) into the
            export. Whether it can be written (a tokenizer the graph
            reproduces, onnxruntime-extensions) is checked before anything
            is converted.

    Returns:
        `pathlib.Path` of the exported directory.

    Raises:
        FileExistsError: `output` exists and `overwrite` is False.
        ValueError: `output` is the preset's directory, or not an earlier
            ONNX export (`check_output`).
        export.validate.ValidationError: the graphs differ from the model, or
            `float32_export` is not a float32 export of it.
    """
    if opset is None:
        opset = DEFAULT_OPSET
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} must be an int in [{MIN_OPSET}, {MAX_OPSET}]")
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} must be one of {QUANTIZATIONS}")
    if float32_export is not None and quantize is None:
        raise ValueError(
            f"float32_export={str(float32_export)!r} is only read to quantize (quantize='int8'); "
            "a float32 export is already that directory"
        )
    output = check_output(output, overwrite, preset)

    model = _load_model(preset)
    refuse_quantized(model, "python -m export.onnx", "--quantize int8 (ONNX Runtime's int8)")
    if with_tokenizer:
        from export.text_graph import check_text_graph_support

        check_text_graph_support(model.tokenizer, preset if isinstance(preset, (str, os.PathLike)) else "the model")
    try:
        fused = build_fused_step(fused_step_weights(model), quantize=quantize, opset=opset)
    except NotFusable as error:
        # The step driver needs the fused step; without it the server runs the whole-search graphs.
        logger.warning("No step driver graphs: %s", error)
        fused = None
    names = [name for name in contract.ONNX.graphs if fused is not None or name not in contract.STEP_DRIVER_GRAPHS]
    files = {name: f"{name}.onnx" for name in names}
    converted = [name for name in names if name != "fused_decoder_step"]
    if float32_export is not None:
        reused = _reusable_graphs(float32_export, model, opset, converted, atol)
    with atomic_directory(output) as staging:
        if float32_export is None:
            for name, (function, signature) in graph_functions(model, converted).items():
                path = staging / files[name]
                logger.info("Converting %s (opset %d)", path.name, opset)
                _convert(function, signature, opset, path)
        else:
            for name in converted:
                logger.info("Reading %s from %s", files[name], float32_export)
                _inline_weights(reused[name], staging / files[name])
        if quantize == "int8":
            for name in converted:
                logger.info("Quantizing %s to int8", files[name])
                _quantize_int8(staging / files[name])
        if fused is not None:
            import onnx

            onnx.save(fused, str(staging / files["fused_decoder_step"]))
        _share_weights(staging, [staging / file for file in files.values()])
        config = _config(model, files, opset, quantize)
        contract.write_config(staging, config)
        if model.tokenizer is not None:
            model.tokenizer.save(staging)
        logger.info("Validating %s against the Keras model", output)
        validate_onnx(staging, model, atol=atol)
        if with_tokenizer:
            from export.text_graph import write_text_graph

            write_text_graph(staging)
    logger.info("Exported %s", output)
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.onnx",
        description="Export a TransformerModel to ONNX (encoder, init_cache and cached decoder step) "
        "and validate it against Keras.",
    )
    parser.add_argument("--preset", required=True,
                        help="built-in preset name, preset directory, Marian checkpoint directory or hf://org/name")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET,
        help=f"ONNX opset, {MIN_OPSET}-{MAX_OPSET} (default {DEFAULT_OPSET})",
    )
    parser.add_argument("--quantize", choices=[q for q in QUANTIZATIONS if q], default=None,
                        help="dynamic int8 quantization of the weights")
    parser.add_argument("--from-float32", metavar="DIR", default=None,
                        help="with --quantize int8: quantize the graphs of DIR, a float32 export of the same "
                        "preset, instead of converting the model again (checked against the preset first)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    cli.add_verbose_argument(parser)
    parser.add_argument("--with-tokenizer", action="store_true",
                        help="also write translate.onnx: text in, text out (needs onnxruntime-extensions)")
    args = parser.parse_args(argv)
    # Our progress at INFO; tf2onnx's and the quantizer's INFO lines are noise here.
    cli.setup_logging(args.verbose)
    logging.getLogger("export").setLevel(logging.INFO)
    try:
        check_output(args.output, args.overwrite, args.preset, flag="--overwrite")
    except (FileExistsError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    try:
        export_onnx(args.preset, args.output, opset=args.opset, quantize=args.quantize, overwrite=args.overwrite,
                    float32_export=args.from_float32, with_tokenizer=args.with_tokenizer)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
