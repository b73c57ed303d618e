"""translate.onnx as an `onnx.ModelProto`: the exported search graphs wrapped in the tokenizer steps.

`build_text_graph` embeds `beam_search.onnx` and `greedy_search.onnx` (the
greedy one's names prefixed, the weights they share held once) in If nodes
between the tokenizer steps of `export/text_graph_tokenizer.py`, with the
inputs, outputs and defaults of `contract.TEXT_GRAPH`;
`build_tokenizer_graphs` gives the tokenizer steps alone. `_GraphBuilder`
collects the nodes. Writing, validating and running the graph:
`export/text_graph.py`.
"""

import json

import numpy as np

from export import contract
from export.graph_passes import _graphs as _subgraphs  # the one walk over a graph and its subgraphs
from export.text_graph_tokenizer import EXTENSIONS_DOMAIN, _decode_ids, _decode_nodes, _source_nodes, check_tokenizer

SEARCH_FILE = "beam_search.onnx"
GREEDY_FILE = "greedy_search.onnx"
# Version of the graph's layout, stored in its metadata.
# 2: greedy_search.onnx's nodes for beam_size 1 (1 ran a beam search of one beam).
TEXT_GRAPH_VERSION = 2
# Our own value names start with this; the beam search graph's keep theirs,
# the greedy one's get `_GREEDY_PREFIX`.
_PREFIX = "translate/"
_GREEDY_PREFIX = "greedy/"


def _graph_names(graph):
    """Every value name used in `graph` and its subgraphs."""
    names = {value.name for value in (*graph.input, *graph.output, *graph.value_info)}
    names.update(init.name for init in graph.initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                names |= _graph_names(attribute.g)
            for subgraph in attribute.graphs:
                names |= _graph_names(subgraph)
    names.discard("")
    return names


class _GraphBuilder:
    """Collects this graph's nodes and initializers, under `_PREFIX` names.

    `const` and `node` append in call order, so the graph is the same for
    the same sequence of calls. A node goes into `into` (a subgraph's node
    list) when given, else into the main graph; constants always become
    main-graph initializers (subgraphs read them from the outer scope).
    """

    def __init__(self):
        self.nodes, self.initializers = [], []

    @staticmethod
    def name(label):
        return _PREFIX + label

    def const(self, label, value, dtype):
        """Adds an initializer `_PREFIX + label` holding `value`; returns its name."""
        from onnx import numpy_helper

        tensor = numpy_helper.from_array(np.array(value, dtype), self.name(label))
        self.initializers.append(tensor)
        return tensor.name

    def node(self, op, inputs, outputs, into=None, **attributes):
        """Adds an `op` node named after its first output; returns its output name(s)."""
        from onnx import helper

        made = helper.make_node(op, inputs, outputs, name=outputs[0], **attributes)
        (self.nodes if into is None else into).append(made)
        return outputs[0] if len(outputs) == 1 else outputs


def _check_search_graph(search_model, spec=contract.BEAM_SEARCH, file=SEARCH_FILE):
    """Checks a search graph's inputs, outputs, opset (13 or newer) and value names.

    Args:
        search_model: `onnx.ModelProto` of `file`.
        spec: its `contract.Graph` (`BEAM_SEARCH` or `GREEDY_SEARCH`).

    Raises:
        ValueError: naming what the search graph has and what is expected.
    """
    search = search_model.graph
    expected_inputs = sorted(spec.input_names())
    if sorted(value.name for value in search.input) != expected_inputs:
        raise ValueError(
            f"The search graph has inputs {sorted(v.name for v in search.input)}; expected "
            f"{expected_inputs} ({file} of export format {contract.ONNX.version})"
        )
    if "sequences" not in {value.name for value in search.output}:
        raise ValueError(f"The search graph {file} has no `sequences` output")
    # Our nodes take the search's opset: they are the same from opset 13 to 18.
    opset = next(o.version for o in search_model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 13:
        raise ValueError(f"The search graph {file} has opset {opset}; translate.onnx needs 13 or newer")
    clash = sorted(
        n for n in _graph_names(search)
        if n.startswith((_PREFIX, _GREEDY_PREFIX)) or n in ("text", "translation")
    )
    if clash:
        raise ValueError(f"The search graph {file} uses names reserved for translate.onnx: {clash[:5]}")


def _tensor_key(tensor):
    """The tensor without its name: equal for equal values (or the same place in weights.bin)."""
    from onnx import TensorProto

    unnamed = TensorProto()
    unnamed.CopyFrom(tensor)
    unnamed.name = ""
    return unnamed.SerializeToString()


def _greedy_graph(greedy_model, beam_graph):
    """`greedy_search.onnx`'s graph, to run beside the beam search's in one model.

    Every value it defines gets `_GREEDY_PREFIX` (both graphs come from
    tf2onnx, whose names repeat with other meanings); it still reads the
    search inputs by their names. Its initializers that equal one of the beam
    search's (the weights: the same bytes of `weights.bin`) read that one
    instead, so the weights are held once.

    Returns:
        `onnx.GraphProto`, whose `sequences` output is `_GREEDY_PREFIX + "sequences"`.
    """
    from onnx import GraphProto

    graph = GraphProto()
    graph.CopyFrom(greedy_model.graph)
    defined = set()
    for inner in _subgraphs(graph):
        defined.update(tensor.name for tensor in inner.initializer)
        defined.update(value.name for value in inner.input)
        defined.update(output for node in inner.node for output in node.output)
    defined -= {"", *contract.GREEDY_SEARCH.input_names()}
    rename = {value: _GREEDY_PREFIX + value for value in defined}
    beam_tensors = {}
    for tensor in beam_graph.initializer:
        beam_tensors.setdefault(_tensor_key(tensor), tensor.name)
    shared = [tensor for tensor in graph.initializer if _tensor_key(tensor) in beam_tensors]
    for tensor in shared:
        rename[tensor.name] = beam_tensors[_tensor_key(tensor)]
        graph.initializer.remove(tensor)
    for inner in _subgraphs(graph):
        for tensor in inner.initializer:
            tensor.name = rename.get(tensor.name, tensor.name)
        for value in (*inner.input, *inner.output, *inner.value_info):
            value.name = rename.get(value.name, value.name)
        for node in inner.node:
            if node.name:
                node.name = _GREEDY_PREFIX + node.name
            for names in (node.input, node.output):
                renamed = [rename.get(value, value) for value in names]
                del names[:]
                names.extend(renamed)
    return graph


def _search_nodes(graph, search, greedy):
    """Step 3: the search graphs' nodes in If nodes, run only when B' > 0.

    As `Translator` (`generation.generate`) chooses: the greedy search's
    nodes (`_greedy_graph`) when `beam_size` is 1, the beam search's
    otherwise (a beam search of one beam is not greedy search: it may end
    with a hypothesis it finished earlier). Their nodes read
    `encoder_token_ids`, `beam_size`, `alpha` and `max_extra_length` from
    this graph by name; their weights become this graph's initializers
    (`build_text_graph` adds them, still stored in weights.bin when the
    export put them there).

    Returns:
        The name of `sequences` [B', L] int32 ([0, 1] when B' = 0).
    """
    from onnx import TensorProto, helper, numpy_helper

    name, node = graph.name, graph.node
    rows = node("Shape", ["encoder_token_ids"], [name("ids_shape")])
    rows = node("Gather", [rows, graph.const("first_axis_1", [0], np.int64)], [name("rows")], axis=0)  # [1]
    any_rows = node("Greater", [rows, graph.const("zero_rows", [0], np.int64)], [name("any_rows")])
    is_greedy = node("Equal", ["beam_size", graph.const("one_beam", 1, np.int32)], [name("is_greedy")])
    run_beam = helper.make_graph(
        list(search.node), "beam_search", [], [helper.make_tensor_value_info("sequences", TensorProto.INT32, None)],
        value_info=list(search.value_info),
    )
    run_greedy = helper.make_graph(
        list(greedy.node), "greedy_search", [],
        [helper.make_tensor_value_info(_GREEDY_PREFIX + "sequences", TensorProto.INT32, None)],
        value_info=list(greedy.value_info),
    )
    choose = helper.make_node("If", [is_greedy], [name("searched")], name=name("searched"), then_branch=run_greedy,
                              else_branch=run_beam)
    run_search = helper.make_graph(
        [choose], "search", [], [helper.make_tensor_value_info(name("searched"), TensorProto.INT32, None)]
    )
    skip_search = helper.make_graph(
        [helper.make_node("Constant", [], [name("no_sequences")],
                          value=numpy_helper.from_array(np.zeros((0, 1), np.int32)))],
        "no_search", [], [helper.make_tensor_value_info(name("no_sequences"), TensorProto.INT32, None)],
    )
    return node("If", [any_rows], [name("sequences")], then_branch=run_search, else_branch=skip_search)


def _contract_values(default_values):
    """The graph's inputs, outputs and defaults, from `contract.TEXT_GRAPH`.

    Args:
        default_values: dict, optional input name -> its default.

    Returns:
        `(inputs, outputs, defaults)`: ValueInfoProtos (dynamic axes by name,
        `batch`) and one initializer per optional input, of the same name
        (ONNX's way of giving an input a default).
    """
    from onnx import helper, numpy_helper

    defaults = [
        numpy_helper.from_array(np.array(default_values[t.name], contract.numpy_dtype(t, None)), t.name)
        for t in contract.TEXT_GRAPH.inputs
        if t.name in contract.TEXT_GRAPH.optional
    ]

    def value_info(tensor):
        elem_type = helper.np_dtype_to_tensor_dtype(contract.numpy_dtype(tensor, None))
        return helper.make_tensor_value_info(tensor.name, elem_type, list(tensor.axes))

    inputs = [value_info(tensor) for tensor in contract.TEXT_GRAPH.inputs]
    outputs = [value_info(tensor) for tensor in contract.TEXT_GRAPH.outputs]
    return inputs, outputs, defaults


def _text_model(graph, search_model, default_values, greedy_model):
    """Wraps `graph` in a ModelProto: the searches' opsets and functions, ours, and the metadata."""
    from onnx import helper

    opsets = [o for o in search_model.opset_import if o.domain != EXTENSIONS_DOMAIN]
    model = helper.make_model(
        graph,
        opset_imports=opsets + [helper.make_opsetid(EXTENSIONS_DOMAIN, 1)],
        ir_version=search_model.ir_version,
        producer_name="keras_transformer export.text_graph",
        doc_string="Text in, text out: SentencePiece encoding, the beam search, SentencePiece decoding. "
        "Needs onnxruntime-extensions (register its library in the session options).",
    )
    model.functions.extend(search_model.functions)
    known = {(function.domain, function.name) for function in search_model.functions}
    model.functions.extend(f for f in greedy_model.functions if (f.domain, f.name) not in known)
    helper.set_model_props(model, {
        "keras_transformer.text_graph_version": str(TEXT_GRAPH_VERSION),
        "keras_transformer.defaults": json.dumps(default_values),
        "keras_transformer.needs": "onnxruntime-extensions (domain ai.onnx.contrib)",
    })
    return model


def build_text_graph(search_model, tokenizer, config, beam_size=4, length_penalty=0.6, max_extra_length=50, *,
                     greedy_model):
    """The `translate.onnx` ModelProto around an exported beam search (and greedy search).

    The steps of the module docstring, in order: `_tokenize_nodes` (or
    `_marian_tokenize_nodes`), `_pad_nodes`, `_search_nodes`,
    `_decode_nodes`; the inputs, outputs and defaults come from
    `export/contract.py` (`_contract_values`).

    Args:
        search_model: `onnx.ModelProto` of `beam_search.onnx`.
        greedy_model: `onnx.ModelProto` of `greedy_search.onnx` (run for
            `beam_size` 1).
        tokenizer: the directory's tokenizer (`load_tokenizer`): a
            `Tokenizer` or a `MarianTokenizer` (`check_tokenizer`).
        config: dict, the directory's `config.json` (ids and
            `max_sequence_length`).
        beam_size, length_penalty, max_extra_length: the defaults of the
            optional inputs `beam_size`, `alpha` and `max_extra_length`.

    Returns:
        `onnx.ModelProto`.

    Raises:
        ValueError: a search graph is not a `beam_search.onnx` (or
            `greedy_search.onnx`) of this export format
            (`_check_search_graph`), or the graph cannot
            tokenize as `tokenizer` (`check_tokenizer`).
    """
    from onnx import helper

    check_tokenizer(tokenizer)
    search = search_model.graph
    _check_search_graph(search_model)
    _check_search_graph(greedy_model, contract.GREEDY_SEARCH, GREEDY_FILE)
    greedy = _greedy_graph(greedy_model, search)
    graph = _GraphBuilder()
    has_pieces = _source_nodes(graph, tokenizer, config)
    sequences = _search_nodes(graph, search, greedy)
    _decode_nodes(graph, has_pieces, sequences, tokenizer, *_decode_ids(config))
    default_values = {"beam_size": beam_size, "alpha": length_penalty, "max_extra_length": max_extra_length}
    inputs, outputs, defaults = _contract_values(default_values)
    text_graph = helper.make_graph(
        graph.nodes, "translate", inputs, outputs,
        initializer=defaults + graph.initializers + list(search.initializer) + list(greedy.initializer),
    )
    return _text_model(text_graph, search_model, default_values, greedy_model)


def build_tokenizer_graphs(tokenizer, config, opset=17):
    """translate.onnx's tokenizer steps alone, as two small models (to check them against the tokenizer).

    - `"encode"`: `text` [B] string -> `encoder_token_ids` [B', W] int32 (the
      rows of the texts with pieces, as the search receives them) and
      `has_pieces` [B] bool.
    - `"decode"`: `text` [B] string (only its length is read) and
      `sequences` [B, L] int32 -> `translation` [B] string.

    Returns:
        dict of `onnx.ModelProto` (they need onnxruntime-extensions).
    """
    from onnx import TensorProto, helper

    check_tokenizer(tokenizer)
    text = helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(EXTENSIONS_DOMAIN, 1)]
    graph = _GraphBuilder()
    has_pieces = _source_nodes(graph, tokenizer, config)
    graph.node("Identity", [has_pieces], ["has_pieces"])
    encode = helper.make_graph(graph.nodes, "encode", [text], [
        helper.make_tensor_value_info("encoder_token_ids", TensorProto.INT32, ["rows", "width"]),
        helper.make_tensor_value_info("has_pieces", TensorProto.BOOL, ["batch"]),
    ], initializer=graph.initializers)
    graph = _GraphBuilder()
    batch = graph.node("Shape", ["text"], [graph.name("text_shape_d")])
    every_text = graph.node("Expand", [graph.const("true", True, np.bool_), batch], [graph.name("every_text")])
    _decode_nodes(graph, every_text, "sequences", tokenizer, *_decode_ids(config))
    sequences = helper.make_tensor_value_info("sequences", TensorProto.INT32, ["batch", "length"])
    decode = helper.make_graph(graph.nodes, "decode", [text, sequences], [
        helper.make_tensor_value_info("translation", TensorProto.STRING, ["batch"]),
    ], initializer=graph.initializers)
    return {name: helper.make_model(g, opset_imports=opsets) for name, g in (("encode", encode), ("decode", decode))}
