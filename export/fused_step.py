"""The decoder step built for ONNX Runtime: fused contrib ops and a cache updated in place.

`fused_step_weights(model)` reads a Keras `TransformerModel`'s decoder weights
(NumPy); `build_fused_step(weights)` emits the decoder step as an ONNX graph
with `onnx.helper`, as onnxruntime-genai's model builder does, instead of
converting the Keras step with tf2onnx (about a thousand small nodes per
step: shape arithmetic, the cache re-stacked and copied). Per decoder layer
(post-LN, the paper's section 5.4):

    q, k, v = Split(x W_qkv + b_qkv)
    x = LayerNorm(x + DecoderMaskedMultiHeadAttention(q, k, v, past) W_o + b_o)
    x = LayerNorm(x + MultiHeadAttention(x W_q + b_q, cross keys, values) W_o + b_o)
    x = LayerNorm(x + act(x W_1 + b_1) W_2 + b_2)

(each `LayerNorm(x + y)` an `Add` and a `LayerNormalization`; below opset
17, ONNX Runtime's `SkipLayerNormalization`). A pre-LN model (`normalize_first`,
NLLB-200's) normalizes each sub-layer's input instead, `x + Sublayer(LayerNorm(x))`,
and the decoder's output once more (`decoder_final_norm`) before the logits.
A model whose search never picks the start id (`exclude_start_logit`: an
imported NLLB-200 one, whose start id shares `</s>`'s embedding row) has
`-inf` in that column of the logits' bias, as `decode_step` sets it.

- The self-attention cache is one `[B*K, N, T, H]` buffer per layer for
  keys and one for values; `DecoderMaskedMultiHeadAttention` writes the
  step's keys and values at `index` in place (`past_present_share_buffer`:
  the caller binds each `present_*` output to its `past_*` input's buffer).
  Beam search never reorders it: `cache_indirection` `[B, K, T]` says from
  which beam of its row each position is read (`update_indirection`).
- The cross-attention keys and values are the source's, `[B, N, S, H]`,
  once per source, not per beam: the K beams of a row are the K queries
  of one `MultiHeadAttention` over them.

The graph is checked against the Keras step when it is exported
(`export/validate.py`): tokens equal on the bundled sentences. Models this
graph does not cover (pre-LN below opset 17, a restricted attention window, key and value
sizes that differ, another activation, a compute dtype other than float32)
are refused by `fused_step_weights` with the reason; their export has no
step driver graphs and the server runs the whole-search graphs.

Framework-free (NumPy and `onnx`): the ONNX exporter builds it, the lean
server (`export/runtime.py`) only runs it.
"""

import math
import typing

import numpy as np

from export import contract

# The contrib ops' domain.
MS_DOMAIN = "com.microsoft"
ACTIVATIONS = ("relu", "silu", "gelu")


class NotFusable(ValueError):
    """The model has a feature the fused step does not implement (the message says which)."""


def fused_step_weights(model, opset=17):
    """The decoder's weights as NumPy arrays for `build_fused_step`, or raises `NotFusable`.

    Args:
        model: a built `TransformerModel`.
        opset: the export's opset (pre-LN needs ONNX's `LayerNormalization`, opset 17).

    Returns:
        dict: `embedding [V, D]`, `positions [P, D]` (the sinusoid table or
        the learned embeddings), `logits_bias [V]` or None, `num_heads`,
        `head_dim`, `epsilon`, `activation`, and `layers`: one dict per
        decoder layer (`self_qkv [D, 3D]`, `self_qkv_bias`, `self_out`,
        `self_out_bias`, `self_norm` (gamma, beta), `cross_query`,
        `cross_query_bias`, `cross_out`, `cross_out_bias`, `cross_norm`,
        `ffn_in`, `ffn_in_bias`, `ffn_out`, `ffn_out_bias`, `ffn_norm`),
        `normalize_first`, `final_norm` (gamma, beta; pre-LN) or None and
        `excluded_id` (the id whose logit is `-inf`) or None.
    """
    import keras

    from keras_transformer.layers.position import sinusoidal_table
    from keras_transformer.model import SINUSOID_LAYOUT

    reasons = []
    if model.normalize_first and opset < 17:
        reasons.append(f"pre-LN (normalize_first=True) at opset {opset} (ONNX's LayerNormalization is opset 17)")
    if model.attention_window is not None:
        reasons.append(f"attention_window={model.attention_window}")
    if model.head_key_dim != model.head_value_dim:
        reasons.append(f"key_dim {model.head_key_dim} != value_dim {model.head_value_dim}")
    activation = model.activation if isinstance(model.activation, str) else getattr(model.activation, "__name__", "")
    if activation not in ACTIVATIONS:
        reasons.append(f"activation={model.activation!r}")
    if model.compute_dtype != "float32":
        reasons.append(f"compute dtype {model.compute_dtype}")
    if reasons:
        raise NotFusable("the fused decoder step does not cover this model: it has " + ", ".join(reasons))

    def array(variable):
        return np.asarray(keras.ops.convert_to_numpy(variable), np.float32)

    def norm(layer):
        return array(layer.gamma), array(layer.beta)

    if model.position_encoding in SINUSOID_LAYOUT:
        layout = SINUSOID_LAYOUT[model.position_encoding]
        positions = np.asarray(
            keras.ops.convert_to_numpy(
                sinusoidal_table(keras.ops.arange(model.max_sequence_length), model.hidden_dim, "float32", layout)
            ),
            np.float32,
        )
    else:
        positions = array(model.decoder_position.position_embeddings)
    layers = []
    for layer in model.decoder_layers:
        self_attention, cross_attention = layer.self_attention, layer.cross_attention
        dense = (self_attention.query_dense, self_attention.key_dense, self_attention.value_dense)
        layers.append({
            "self_qkv": np.concatenate([array(d.kernel) for d in dense], axis=1),
            "self_qkv_bias": np.concatenate([array(d.bias) for d in dense]),
            "self_out": array(self_attention.output_dense.kernel),
            "self_out_bias": array(self_attention.output_dense.bias),
            "self_norm": norm(layer.self_attention_norm),
            "cross_query": array(cross_attention.query_dense.kernel),
            "cross_query_bias": array(cross_attention.query_dense.bias),
            "cross_out": array(cross_attention.output_dense.kernel),
            "cross_out_bias": array(cross_attention.output_dense.bias),
            "cross_norm": norm(layer.cross_attention_norm),
            "ffn_in": array(layer.feedforward_intermediate.kernel),
            "ffn_in_bias": array(layer.feedforward_intermediate.bias),
            "ffn_out": array(layer.feedforward_output.kernel),
            "ffn_out_bias": array(layer.feedforward_output.bias),
            "ffn_norm": norm(layer.feedforward_norm),
        })
    return {
        "embedding": array(model.token_embedding.embeddings),
        "positions": positions,
        "logits_bias": array(model.logits_bias_weight) if model.logits_bias else None,
        "num_heads": int(model.num_heads),
        "head_dim": int(model.head_key_dim),
        "epsilon": float(model.layer_norm_epsilon),
        "activation": activation,
        "layers": layers,
        "normalize_first": bool(model.normalize_first),
        "final_norm": norm(model.decoder_final_norm) if model.normalize_first else None,
        "excluded_id": int(model.start_id) if getattr(model, "exclude_start_logit", False) else None,
    }


class _StepGraph:
    """The fused step's nodes and initializers, appended in call order (the same calls give the same graph).

    `const` adds an initializer once per name (a shape constant is shared by
    the layers); `node` names its outputs after the op and a counter;
    `linear` and `residual_norm` are the two blocks every layer is made of,
    as `quantize`, `opset` and the layer norms' `epsilon` ask.
    """

    def __init__(self, quantize, opset, epsilon):
        self.quantize, self.opset, self.epsilon = quantize, opset, epsilon
        self.nodes, self.initializers, self.names = [], [], set()
        self.counter = iter(range(1 << 30))

    def const(self, name, value):
        from onnx import numpy_helper

        if name not in self.names:  # a shape constant is made once and shared by the layers
            self.names.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op, inputs, outputs=1, domain="", **attributes):
        from onnx import helper

        number = next(self.counter)
        names = [f"{op.lower()}_{number}_{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, names, name=f"{op}_{number}", domain=domain, **attributes))
        return names[0] if len(names) == 1 else names

    def linear(self, x, name, kernel, bias=None):
        """`x kernel (+ bias)`: float32, or int8 weights with a scale per output column."""
        const, node = self.const, self.node
        if self.quantize == "int8":
            scale = np.abs(kernel).max(axis=0) / 127.0
            scale[scale == 0] = 1.0
            weights_int8 = np.clip(np.rint(kernel / scale), -127, 127).astype(np.int8)
            inputs = [x, const(f"{name}_int8", weights_int8), const(f"{name}_scale", scale.astype(np.float32)),
                      const(f"{name}_zero_point", np.zeros(kernel.shape[1], np.int8))]
            inputs += [const(f"{name}_bias", bias)] if bias is not None else []
            return node("DynamicQuantizeMatMul", inputs, domain=MS_DOMAIN)
        y = node("MatMul", [x, const(name, kernel)])
        return y if bias is None else node("Add", [y, const(f"{name}_bias", bias)])

    def layer_norm(self, x, norm, name):
        """LayerNorm(x) (opset 17's `LayerNormalization`)."""
        gamma, beta = (self.const(f"{name}_{part}", value) for part, value in zip(("gamma", "beta"), norm))
        return self.node("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=self.epsilon)

    def sublayer(self, x, norm, name, normalize_first, body):
        """`LayerNorm(x + body(x))` (post-LN) or `x + body(LayerNorm(x))` (pre-LN)."""
        if normalize_first:
            return self.node("Add", [x, body(self.layer_norm(x, norm, name))])
        return self.residual_norm(body(x), x, norm, name)

    def residual_norm(self, sublayer_output, residual, norm, name):
        # LayerNorm(x + Sublayer(x)) (post-LN): an Add and a LayerNormalization, not ONNX Runtime's
        # fused SkipLayerNormalization, whose CPU kernel took 4-6x their time here from 16 rows up
        # (onnxruntime 1.32, one thread: 88 us vs 18 us at [64, 256]; benchmarks/README.md). Below
        # opset 17, which has no LayerNormalization, the fused op.
        const, node, epsilon = self.const, self.node, self.epsilon
        gamma, beta = (const(f"{name}_{part}", value) for part, value in zip(("gamma", "beta"), norm))
        if self.opset < 17:
            return node("SkipLayerNormalization", [sublayer_output, residual, gamma, beta], domain=MS_DOMAIN,
                        epsilon=epsilon)
        return node("LayerNormalization", [node("Add", [sublayer_output, residual]), gamma, beta], axis=-1,
                    epsilon=epsilon)


def _step_values(weights):
    """The step's inputs and outputs (`contract.FUSED_DECODER_STEP`) as ValueInfoProtos, sizes filled in."""
    from onnx import TensorProto, helper

    graph_spec = contract.FUSED_DECODER_STEP.expand(len(weights["layers"]))
    sizes = {"num_heads": weights["num_heads"], "head_key_dim": weights["head_dim"],
             "head_value_dim": weights["head_dim"], "vocabulary_size": weights["embedding"].shape[0]}
    types = {"int32": TensorProto.INT32, "float32": TensorProto.FLOAT, contract.COMPUTE: TensorProto.FLOAT}

    def value_info(tensor):
        dims = [axis if size is None else size for axis, size in zip(tensor.axes, contract.shape(tensor, sizes))]
        return helper.make_tensor_value_info(tensor.name, types[tensor.dtype], dims)

    return [value_info(t) for t in graph_spec.inputs], [value_info(t) for t in graph_spec.outputs]


class _Shapes(typing.NamedTuple):
    """The values every layer reads (`_shapes`)."""

    qkv: str  # [-1, 1, 3D]: the self-attention's rows
    row: str  # [-1, D]
    source: str  # [-1, K, D]: the cross-attention's queries, K beams per source
    past_length: str  # [1], `index`
    beam_width: str  # int32 [1], K


def _shapes(graph, hidden):
    """Shapes used by every layer: [B*K, 1, D] for the self-attention, [B, K, D] for the cross-attention."""
    from onnx import TensorProto

    const, node = graph.const, graph.node
    qkv_shape = const("qkv_shape", np.array([-1, 1, 3 * hidden], np.int64))
    row_shape = const("row_shape", np.array([-1, hidden], np.int64))
    beam_size = node("Slice", [node("Shape", ["cache_indirection"]), const("one", np.array([1], np.int64)),
                               const("two", np.array([2], np.int64))])
    source_shape = node("Concat", [const("minus_one", np.array([-1], np.int64)), beam_size,
                                   const("hidden", np.array([hidden], np.int64))], axis=0)
    past_length = node("Reshape", ["index", const("one_element", np.array([1], np.int64))])
    beam_width = node("Cast", [beam_size], to=TensorProto.INT32)
    return _Shapes(qkv_shape, row_shape, source_shape, past_length, beam_width)


def _embedding_nodes(graph, weights):
    """`x` [B*K, D] of the step's tokens at `index`, and the embedding matrix's name (None under int8)."""
    const, node = graph.const, graph.node
    hidden = weights["embedding"].shape[1]
    # Embedding: E[token] * sqrt(d_model) + PE[index] (section 3.4, 3.5); no dropout at inference.
    scale = np.float32(math.sqrt(hidden))
    embedding = None
    if graph.quantize == "int8":  # the float32 matrix serves the lookup only: scaled once here (same products)
        x = node("Gather", [const("scaled_embedding", weights["embedding"] * scale), "decoder_token_ids"])
    else:  # one matrix for the lookup and the output layer (section 3.4)
        embedding = const("embedding", weights["embedding"])
        x = node("Mul", [node("Gather", [embedding, "decoder_token_ids"]), const("embedding_scale", scale)])
    x = node("Add", [x, node("Gather", [const("positions", weights["positions"]), "index"])])  # [B*K, D]
    return x, embedding


def _decoder_layer_nodes(graph, i, layer, x, shapes, weights):
    """Decoder layer `i` on `x` [B*K, D] (the module docstring's equations); returns its output [B*K, D]."""
    const, node, linear = graph.const, graph.node, graph.linear
    heads, head_dim = weights["num_heads"], weights["head_dim"]
    hidden = weights["embedding"].shape[1]
    first = weights.get("normalize_first", False)
    p = f"layer_{i}"

    def self_attention(y):
        qkv = linear(y, f"{p}_self_qkv", layer["self_qkv"], layer["self_qkv_bias"])
        qkv = node("Reshape", [qkv, shapes.qkv])  # [B*K, 1, 3D]: one reshape, not one each for q, k and v
        q, k, v = node("Split", [qkv, const("qkv_split", np.array([hidden] * 3, np.int64))], outputs=3, axis=2)
        attended = node("DecoderMaskedMultiHeadAttention", [
            q, k, v, "", "", f"self_key_{i}", f"self_value_{i}", shapes.past_length, shapes.beam_width,
            "cache_indirection",
        ], outputs=[f"{p}_self_attention", f"present_self_key_{i}", f"present_self_value_{i}"], domain=MS_DOMAIN,
            num_heads=heads, past_present_share_buffer=1, scale=float(head_dim**-0.5))[0]
        attended = node("Reshape", [attended, shapes.row])
        return linear(attended, f"{p}_self_out", layer["self_out"], layer["self_out_bias"])

    def cross_attention(y):
        query = linear(y, f"{p}_cross_query", layer["cross_query"], layer["cross_query_bias"])
        attended = node("MultiHeadAttention", [
            node("Reshape", [query, shapes.source]), f"cross_key_{i}", f"cross_value_{i}", "",
            "encoder_padding_mask",
        ], domain=MS_DOMAIN, num_heads=heads, scale=float(head_dim**-0.5))  # [B, K, D]
        attended = node("Reshape", [attended, shapes.row])
        return linear(attended, f"{p}_cross_out", layer["cross_out"], layer["cross_out_bias"])

    def feedforward(y):
        hidden_units = linear(y, f"{p}_ffn_in", layer["ffn_in"], layer["ffn_in_bias"])
        if weights["activation"] == "relu":
            hidden_units = node("Relu", [hidden_units])
        elif weights["activation"] == "silu":
            hidden_units = node("Mul", [hidden_units, node("Sigmoid", [hidden_units])])
        else:
            hidden_units = node("Gelu", [hidden_units], domain=MS_DOMAIN)
        return linear(hidden_units, f"{p}_ffn_out", layer["ffn_out"], layer["ffn_out_bias"])

    x = graph.sublayer(x, layer["self_norm"], f"{p}_self_norm", first, self_attention)
    x = graph.sublayer(x, layer["cross_norm"], f"{p}_cross_norm", first, cross_attention)
    return graph.sublayer(x, layer["ffn_norm"], f"{p}_ffn_norm", first, feedforward)


def _logits_nodes(graph, x, weights, embedding):
    """The output `logits` [B*K, V] of `x` [B*K, D]."""
    from onnx import helper

    if weights.get("final_norm") is not None:  # pre-LN: the decoder's output normalized once more
        x = graph.layer_norm(x, weights["final_norm"], "decoder_final_norm")
    # The pre-softmax projection with the embedding matrix (section 3.4): x E^T (+ an imported model's bias).
    logits_bias = weights["logits_bias"]
    if weights.get("excluded_id") is not None:  # -inf in the excluded id's column: its logit is -inf, as in decode_step
        logits_bias = np.zeros(weights["embedding"].shape[0], np.float32) if logits_bias is None else logits_bias.copy()
        logits_bias[weights["excluded_id"]] = -np.inf
    if graph.quantize == "int8":
        logits = graph.linear(x, "logits_projection", weights["embedding"].T, logits_bias)
        graph.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
    else:
        gemm_inputs = [x, embedding] + ([graph.const("logits_bias", logits_bias)] if logits_bias is not None else [])
        graph.nodes.append(helper.make_node("Gemm", gemm_inputs, ["logits"], name="logits", transB=1))


def build_fused_step(weights, quantize=None, opset=17):
    """The decoder step as an `onnx.ModelProto` (see the module docstring).

    `quantize="int8"`: every matrix product (the projections, the FFN and
    the output layer) is ONNX Runtime's `DynamicQuantizeMatMul` with int8
    weights and one scale per output column (symmetric), its input
    quantized at run time; the embedding lookup stays float32. `opset`:
    the standard domain's (the export's).

    Its inputs and outputs are `contract.FUSED_DECODER_STEP`'s: the ids
    `[B*K]` at position `index`, `cache_indirection` `[B, K, T]`,
    `encoder_padding_mask` (int32, 1 for real source tokens), per layer i
    `self_key_i` / `self_value_i` `[B*K, N, T, H]` and `cross_key_i` /
    `cross_value_i` `[B, N, S, H]`; `logits` `[B*K, V]` (position index + 1)
    and `present_self_*_i` (the `self_*_i` buffers, written at `index`).

    Built in steps, in this order (the nodes are numbered as they are
    made): `_shapes`, `_embedding_nodes`, `_decoder_layer_nodes` per layer,
    `_logits_nodes`.
    """
    import onnx
    from onnx import helper

    graph = _StepGraph(quantize, opset, weights["epsilon"])
    inputs, outputs = _step_values(weights)
    shapes = _shapes(graph, weights["embedding"].shape[1])
    x, embedding = _embedding_nodes(graph, weights)
    for i, layer in enumerate(weights["layers"]):
        x = _decoder_layer_nodes(graph, i, layer, x, shapes, weights)
    _logits_nodes(graph, x, weights, embedding)
    model = helper.make_model(
        helper.make_graph(graph.nodes, "fused_decoder_step", inputs, outputs, graph.initializers),
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="keras_transformer.export.fused_step",
    )
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model, full_check=False)
    return model


# The output `with_alignment_output` adds: `[B*K, S]`, the aligning layer's cross-attention averaged over its heads.
ALIGNMENT_OUTPUT = "alignment_attention"


def with_alignment_output(step, layer=-1):
    """A copy of the fused step `step` (an `onnx.ModelProto`) that also outputs `ALIGNMENT_OUTPUT`.

    The output is decoder layer `layer`'s cross-attention weights averaged
    over its heads, float32 `[B*K, S]` (`keras_transformer.documents.alignment`):
    `softmax(q k^T * scale)` over the real source positions, from the query
    and keys that layer's `MultiHeadAttention` reads (the contrib op gives
    no weights), then the mean over the heads. Made when alignments are
    asked for (`OnnxSeq2Seq.alignment_attention`), from the graph an export
    holds: the exported step and its runs stay as they are, and an export
    made before this output existed gets it too.

    Raises:
        ValueError: the graph has no cross-attention node reading that
            layer's `cross_key_<i>` (not a fused step this function knows).
    """
    from onnx import TensorProto, helper

    step = _copy(step)
    graph = step.graph
    layers = sum(1 for value in graph.input if value.name.startswith("cross_key_"))
    index = layer % max(layers, 1)
    found = [node for node in graph.node
             if node.op_type == "MultiHeadAttention" and list(node.input[1:2]) == [f"cross_key_{index}"]]
    if len(found) != 1:
        raise ValueError(f"the fused decoder step has no cross-attention node reading cross_key_{index}; "
                         "export the model again with this version (python -m export.onnx)")
    query, keys = found[0].input[0], found[0].input[1]  # [B, K, D], [B, N, S, H]
    attributes = {a.name: helper.get_attribute_value(a) for a in found[0].attribute}
    opset = next(o.version for o in step.opset_import if o.domain in ("", "ai.onnx"))

    def const(name, dtype, values):
        graph.initializer.append(helper.make_tensor(f"{ALIGNMENT_OUTPUT}_{name}", dtype, [len(values)], values))
        return f"{ALIGNMENT_OUTPUT}_{name}"

    def node(op, inputs, name, **kwargs):
        output = name if name == ALIGNMENT_OUTPUT else f"{ALIGNMENT_OUTPUT}_{name}"
        graph.node.append(helper.make_node(op, inputs, [output], name=output, **kwargs))
        return output

    heads = node("Reshape", [query, const("heads_shape", TensorProto.INT64, [0, 0, attributes["num_heads"], -1])],
                 "query_heads")  # [B, K, N, H]
    scores = node("MatMul", [node("Transpose", [heads], "query", perm=[0, 2, 1, 3]),
                             node("Transpose", [keys], "keys", perm=[0, 1, 3, 2])], "products")  # [B, N, K, S]
    scores = node("Mul", [scores, const("scale", TensorProto.FLOAT, [attributes["scale"]])], "scores")
    real = node("Cast", ["encoder_padding_mask"], "real", to=TensorProto.BOOL)
    if opset >= 13:
        real = node("Unsqueeze", [real, const("mask_axes", TensorProto.INT64, [1, 2])], "real_positions")
    else:
        real = node("Unsqueeze", [real], "real_positions", axes=[1, 2])  # [B, 1, 1, S]
    scores = node("Where", [real, scores, const("masked", TensorProto.FLOAT, [-1e30])], "masked_scores")
    weights = node("Softmax", [scores], "weights", axis=-1)
    if opset >= 18:
        mean = node("ReduceMean", [weights, const("head_axis", TensorProto.INT64, [1])], "mean", keepdims=0)
    else:
        mean = node("ReduceMean", [weights], "mean", axes=[1], keepdims=0)  # [B, K, S]
    node("Flatten", [mean], ALIGNMENT_OUTPUT, axis=2)  # [B*K, S]
    graph.output.append(helper.make_tensor_value_info(ALIGNMENT_OUTPUT, TensorProto.FLOAT, ["beam_rows", "source_length"]))
    return step


def _copy(step):
    copy = type(step)()
    copy.CopyFrom(step)
    return copy


def update_indirection(indirection, parents, index):
    """The beams' cache indirection after a beam search step that picked `parents`.

    New beam k of row b continues beam `parents[b, k]`: it reads positions
    before `index` from where its parent read them, and position `index`
    (written by the parent's row at this step) from the parent.

    Args:
        indirection: int32 `[B, K, T]`.
        parents: int `[B, K]`, the beam (0..K-1) each new beam continues.
        index: the step's position.

    Returns:
        int32 `[B, K, T]` (a new array).
    """
    indirection = indirection[np.arange(len(parents))[:, None], parents]  # [B, K, T], beam k <- its parent's
    indirection[:, :, index] = parents
    return indirection
