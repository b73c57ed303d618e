"""Passes over the ONNX graphs tf2onnx converts: what makes `export.onnx`'s graphs leaner.

Each pass rewrites an `onnx.ModelProto` or `GraphProto` in place, in the graph
and its subgraphs (a Loop's body), and leaves what it does not match exactly
as it was; every export is validated against Keras afterwards. `_convert`
(`export/onnx.py`) runs them in turn: loop invariants hoisted, Keras'
tensordot reshapes and negative-index fixes dropped, nodes that compute
nothing removed, constants folded, layer norms fused, unused initializers
dropped; `_copy_outer_weights_into_loops` readies a graph for ONNX Runtime's
int8 quantizer. NumPy and `onnx` only.
"""

import numpy as np


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
    """`graph` and, depth first, every graph below it: the bodies and branches of its nodes (a Loop's, an If's)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                yield from _graphs(attribute.g)
            for subgraph in attribute.graphs:
                yield from _graphs(subgraph)


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
