"""The contract of an exported model: its graphs, their tensors, the formats.

One table per export format (`ONNX`, `SAVED_MODEL`) names each exported
graph and the `Graph` it is: the model method it comes from and its input
and output tensors, each with a name, a dtype and named axes. Everything
else is derived from it:

- `export/graphs.py`: the TensorFlow input signatures of the traced
  functions, which tf2onnx converts (`export/onnx.py`) and the SavedModel
  saves (`export/saved_model.py`);
- the names, dtypes, dynamic axes and fixed sizes of every ONNX graph
  (`check_tensors`; `check_graph_signature` for an ONNX Runtime session),
  which `export/validate.py` checks at export and `export/runtime.py` when
  it loads a graph, and the feeds they build (`feeds`);
- both exporters' `config.json`: the format and its version
  (`Format.header`), the model's ids and sizes (`model_fields`), the
  exporting versions (`versions`) and the SavedModel's signatures
  (`describe_graphs`).

Framework-free (the standard library and NumPy): the ONNX Runtime server
imports it; `versions` imports the packages it records when it is called.

Axes: a dynamic axis has one of the names of `DYNAMIC_AXES`; a fixed one is
named by the `config.json` key that holds its size (`FIXED_AXES`). The
letters are the shape legend of the docstrings and of the SavedModel's
config.json.
"""

import dataclasses
import importlib
import json
import pathlib

import numpy as np

from keras_transformer.decoding import NO_PATIENCE
from keras_transformer.presets import jsonable_config


class UnsupportedModelError(ValueError):
    """The model uses something an export format cannot express (one line naming the option)."""


def check_exportable(model, target, languages=False):
    """Raises `UnsupportedModelError` for an imported FSMT model, and an NLLB-200 / M2M-100 one unless the format carries it.

    Such a model has fairseq's sinusoids, language codes and a target-language
    code the search is forced to (`Translator.with_languages`), and its search
    never picks the start id (`exclude_start_logit`). ONNX and CTranslate2
    carry all of these (`languages=True`); a format that does not would
    translate wrongly, so it is refused.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if getattr(tokenizer, "format", None) == "fsmt":
        raise UnsupportedModelError(
            f"{target} export of an FSMT model (fairseq's WMT19) is not supported: its Moses tokenizer and BPE "
            "have no SentencePiece or text-graph form, and its fairseq positions and excluded start logit are not "
            "in the exported graphs; translate it with keras_transformer.Translator"
        )
    if languages:
        return
    if (model.position_encoding == "sinusoidal_fairseq" or hasattr(tokenizer, "with_languages")
            or getattr(model, "exclude_start_logit", False)):
        raise UnsupportedModelError(
            f"{target} export of an NLLB-200 / M2M-100 model (position_encoding='sinusoidal_fairseq', "
            "exclude_start_logit, language codes) is not supported; export it with python -m export.onnx or "
            "python -m export.ctranslate2, or translate it with keras_transformer.Translator (source_language=, "
            "target_language=)"
        )


def feed_forward_activation(model, names, target):
    """`names[a]` for the one feed-forward activation `a` (Keras' name) that every layer of `model` uses.

    Args:
        names: dict, Keras' activation name -> the format's.
        target: the format, for the message (e.g. "a Marian checkpoint").

    Raises:
        UnsupportedModelError: the layers mix activations, or use one `names` lacks.
    """
    import keras

    found = {keras.activations.serialize(layer.activation) for layer in (*model.encoder_layers, *model.decoder_layers)}
    if len(found) != 1 or not found <= set(names):
        raise UnsupportedModelError(
            f"the feed-forward activation(s) {sorted(found)} cannot be exported as {target}: its layers share one "
            f"activation, of which this exporter maps {sorted(names)}"
        )
    return names[found.pop()]

CONFIG_FILE = "config.json"
# Dynamic axis -> its letter.
DYNAMIC_AXES = {
    "batch": "B", "source_length": "S", "cache_length": "T_max", "output_length": "T_out",
    "hypotheses": "N_best", "prefix_length": "P", "beam": "W", "beam_rows": "B*W",
}
# Fixed axis (a config.json key, the size) -> its letter.
FIXED_AXES = {
    "hidden_dim": "D", "num_decoder_layers": "L", "num_heads": "N", "head_key_dim": "K",
    "head_value_dim": "Vh", "vocabulary_size": "V",
}
# The special ids' names, as the model, the tokenizers and every config.json
# name them (their values have one home: `keras_transformer.tokenizers.sentencepiece`).
SPECIAL_IDS = ("pad_id", "unk_id", "start_id", "end_id")
# The characters Python's `str.isspace()` is true for, as an RE2 class (TensorFlow's
# and onnxruntime-extensions' regular expressions): the graphs strip and skip
# whitespace as `str.strip()` does.
WHITESPACE_RE2 = r"[\t-\r\x{1c}-\x{1f}\x{85}\p{Z}]"
# The dtype of the model's activations and caches (config.json `cache_dtype`).
COMPUTE = "compute"
_NUMPY_DTYPES = {"string": object}


class ValidationError(ValueError):
    """An exported graph does not match the contract or the Keras model."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One input or output: its name, dtype (a NumPy name, "string" or `COMPUTE`) and axes."""

    name: str
    dtype: str
    axes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Graph:
    """One exported function: what it computes (`method`) and its tensors, in signature order.

    `optional` names the inputs that have a default in the graph.
    """

    method: str
    inputs: tuple
    outputs: tuple
    optional: tuple = ()

    def input_names(self):
        return [tensor.name for tensor in self.inputs]

    def output_names(self):
        return [tensor.name for tensor in self.outputs]

    def expand(self, num_layers):
        """This graph with each tensor named with `LAYER` repeated per layer (`self_key_0`, ...)."""

        def tensors(group):
            return tuple(
                dataclasses.replace(tensor, name=tensor.name.format(layer=i))
                for tensor in group for i in (range(num_layers) if LAYER in tensor.name else (None,))
            )

        return dataclasses.replace(self, inputs=tensors(self.inputs), outputs=tensors(self.outputs))


@dataclasses.dataclass(frozen=True)
class Format:
    """An export format: its name and version in config.json, and its graphs by exported name."""

    name: str
    version: int
    graphs: dict

    def header(self):
        return {"format": self.name, "format_version": self.version}


def _ids(name, *axes):
    return Tensor(name, "int32", axes)


def _scalar(name, dtype="int32"):
    return Tensor(name, dtype)


_SOURCE_IDS = _ids("encoder_token_ids", "batch", "source_length")
_ENCODER_OUTPUTS = Tensor("encoder_outputs", COMPUTE, ("batch", "source_length", "hidden_dim"))
_PADDING_MASK = Tensor("encoder_padding_mask", "bool", ("batch", "source_length"))


def _cache(name, length, size):
    """A cache entry, heads first: `[B, L, N, T_max or S, K or Vh]`."""
    return Tensor(name, COMPUTE, ("batch", "num_decoder_layers", "num_heads", length, size))


_SELF_CACHE = (
    _cache("self_key", "cache_length", "head_key_dim"), _cache("self_value", "cache_length", "head_value_dim"),
)
_CROSS_CACHE = (
    _cache("cross_key", "source_length", "head_key_dim"), _cache("cross_value", "source_length", "head_value_dim"),
)
_SEARCH_OUTPUTS = (_ids("sequences", "batch", "output_length"), Tensor("scores", "float32", ("batch",)))
_SEARCH_ARGUMENTS = (_scalar("beam_size"), _scalar("alpha", "float32"), _scalar("max_extra_length"))
_TARGET_PREFIX = _ids("target_prefix", "batch", "prefix_length")
_HYPOTHESES_OUTPUTS = (
    _ids("sequences", "batch", "hypotheses", "output_length"),
    Tensor("scores", "float32", ("batch", "hypotheses")),
    Tensor("log_probs", "float32", ("batch", "hypotheses")),
)
_SAMPLING_ARGUMENTS = (
    _ids("sample_key", "batch"), _scalar("seed"), _scalar("sampling_topk"),
    _scalar("sampling_topp", "float32"), _scalar("sampling_temperature", "float32"),
)
_TEXT = Tensor("text", "string", ("batch",))
_TRANSLATION = Tensor("translation", "string", ("batch",))

# The decoding protocol of `keras_transformer.generation`, one graph per method.
ENCODE = Graph("TransformerModel.encode", (_SOURCE_IDS,), (_ENCODER_OUTPUTS,))
INIT_CACHE = Graph(
    "TransformerModel.init_cache",
    (_ENCODER_OUTPUTS, _SOURCE_IDS, _scalar("max_length")),
    (*_SELF_CACHE, *_CROSS_CACHE, _PADDING_MASK),
)
# An ONNX graph cannot reuse an input's name for an output: the updated caches are `updated_*`.
DECODE_STEP = Graph(
    "TransformerModel.decode_step",
    (_ids("decoder_token_ids", "batch"), _scalar("step"), *_SELF_CACHE, *_CROSS_CACHE, _PADDING_MASK),
    (
        Tensor("logits", "float32", ("batch", "vocabulary_size")),
        *(dataclasses.replace(tensor, name=f"updated_{tensor.name}") for tensor in _SELF_CACHE),
    ),
)
# The whole search (`generation.search_graph`); rows are not trimmed (`decoding.finish_rows`).
GREEDY_SEARCH = Graph(
    "generation.search_graph(model, 'greedy')", (_SOURCE_IDS, *_SEARCH_ARGUMENTS[1:]), _SEARCH_OUTPUTS
)
BEAM_SEARCH = Graph("generation.search_graph(model, 'beam')", (_SOURCE_IDS, *_SEARCH_ARGUMENTS), _SEARCH_OUTPUTS)
# The search of `generation.generate_hypotheses` (`generation.hypotheses_graph`), options as inputs:
# n-best beam search with target prefixes; sampling (and greedy search: `sampling_topk` 1) with them.
BEAM_HYPOTHESES = Graph(
    "generation.hypotheses_graph(model, 'beam')",
    (
        _SOURCE_IDS, _TARGET_PREFIX, _SEARCH_ARGUMENTS[0], _scalar("num_hypotheses"), _scalar("ended_to_stop"),
        *_SEARCH_ARGUMENTS[1:],
    ),
    _HYPOTHESES_OUTPUTS,
)
# One hypothesis per row: the outputs of `hypotheses_graph(model, 'sample')` without their axis of size 1.
SAMPLE_SEARCH = Graph(
    "generation.hypotheses_graph(model, 'sample'), hypotheses axis dropped",
    (_SOURCE_IDS, _TARGET_PREFIX, *_SAMPLING_ARGUMENTS, *_SEARCH_ARGUMENTS[1:]),
    (*_SEARCH_OUTPUTS, Tensor("log_probs", "float32", ("batch",))),
)

# A search run step by step (`generation.start_graph`, `generation.step_graph`; `export/runtime.py`
# drives them): the state's fields (`search/beam.py`, `search/sample.py` STATE_SPEC, the same names,
# dtypes and axes; B batch, K beam, L output_length, P prefix_length) and the cache, `[B * K, ...]`.
# The search's axis letters -> the contract's axis names.
STATE_AXES = {"B": "batch", "K": "beam", "L": "output_length", "P": "prefix_length"}
_INDEX = _scalar("index")
_BEAM_STATE = (
    _INDEX,
    _ids("live_sequences", "batch", "beam", "output_length"),
    Tensor("live_log_probs", "float32", ("batch", "beam")),
    _ids("finished_sequences", "batch", "beam", "output_length"),
    Tensor("finished_scores", "float32", ("batch", "beam")),
    Tensor("finished_log_probs", "float32", ("batch", "beam")),
    _ids("ended", "batch"),
)
_BEAM_OPTIONS = (_TARGET_PREFIX, _scalar("num_hypotheses"), _scalar("ended_to_stop"))
_SAMPLE_STATE = (
    _INDEX,
    _ids("sequences", "batch", "output_length"),
    Tensor("log_probs", "float32", ("batch",)),
    Tensor("scores", "float32", ("batch",)),
    Tensor("finished", "bool", ("batch",)),
)
_SAMPLE_OPTIONS = (_TARGET_PREFIX, *_SAMPLING_ARGUMENTS)


def _rows(tensor):
    """The cache entry of a search run step by step: one row per beam, `[B * K, ...]`."""
    return dataclasses.replace(tensor, axes=("beam_rows", *tensor.axes[1:]))


_SOURCE_CACHE = (*_CROSS_CACHE, _PADDING_MASK)
_MAX_LENGTHS = _ids("max_lengths", "batch")
_BUFFER_LENGTH = _scalar("buffer_length")
_NEXT_IDS = _ids("decoder_token_ids", "beam_rows")
_UPDATE_OUTPUTS = (
    Tensor("rows_done", "bool", ("batch",)),
    Tensor("keep_going", "bool"),
    _ids("hypotheses_sequences", "batch", "hypotheses", "output_length"),
    Tensor("hypotheses_scores", "float32", ("batch", "hypotheses")),
    Tensor("hypotheses_log_probs", "float32", ("batch", "hypotheses")),
)


def _updated(tensors):
    return tuple(dataclasses.replace(tensor, name=f"updated_{tensor.name}") for tensor in tensors)


def _start(method, options, state):
    return Graph(
        method,
        (_SOURCE_IDS, _TARGET_PREFIX, *options, _scalar("max_extra_length")),
        (*state, _NEXT_IDS, *_SOURCE_CACHE, _MAX_LENGTHS, _BUFFER_LENGTH),
    )


def _one_hypothesis(tensor):
    """A hypotheses output of sampling: one per row, without the axis of size 1 (as `sample_search`)."""
    return dataclasses.replace(tensor, axes=tuple(axis for axis in tensor.axes if axis != "hypotheses"))


def _update(method, state, options, hypotheses=True, parents=False):
    outputs = _UPDATE_OUTPUTS if hypotheses else tuple(_one_hypothesis(tensor) for tensor in _UPDATE_OUTPUTS)
    return Graph(
        method,
        (*state, *options, Tensor("logits", "float32", ("beam_rows", "vocabulary_size")), _MAX_LENGTHS,
         _scalar("alpha", "float32"), _BUFFER_LENGTH),
        (*_updated(state), _NEXT_IDS, *((_ids("parents", "batch", "beam"),) if parents else ()), *outputs),
    )


BEAM_START = _start("generation.start_graph(model, 'beam')", (_scalar("beam_size"),), _BEAM_STATE)
BEAM_UPDATE = _update("generation.update_graph(model, 'beam')", _BEAM_STATE, _BEAM_OPTIONS, parents=True)
# Sampling and greedy search share their state's changing fields, so one start graph serves both.
SAMPLE_START = _start("generation.start_graph(model, 'sample') (and 'greedy')", (), _SAMPLE_STATE)
# One hypothesis per row: the hypotheses outputs without their axis of size 1, as `sample_search`'s.
SAMPLE_UPDATE = _update(
    "generation.update_graph(model, 'sample'), hypotheses axis dropped", _SAMPLE_STATE, _SAMPLE_OPTIONS,
    hypotheses=False,
)
# Greedy search has its own update graph: as sampling with `sampling_topk` 1 it would sort the
# vocabulary every step (the same tokens, several times slower).
GREEDY_UPDATE = _update(
    "generation.update_graph(model, 'greedy'), hypotheses axis dropped", _SAMPLE_STATE, (_TARGET_PREFIX,),
    hypotheses=False,
)
# A tensor per decoder layer: `{layer}` in its name (`Graph.expand`).
LAYER = "{layer}"
# The decoder step built for ONNX Runtime (`export/fused_step.py`): the self-attention cache is one
# buffer per layer, keys and values, that `present_*` shares with its input (written at `index`,
# read through `cache_indirection` [B, K, T], the beam each position is read from); the
# cross-attention cache once per source. Exported for the models it covers (post-LN float32).
_LAYER_SELF_CACHE = tuple(
    Tensor(f"self_{kind}_{LAYER}", COMPUTE, ("beam_rows", "num_heads", "cache_length", size))
    for kind, size in (("key", "head_key_dim"), ("value", "head_value_dim"))
)
FUSED_DECODER_STEP = Graph(
    "export.fused_step.build_fused_step (from the model's weights)",
    (
        _NEXT_IDS, _scalar("index"), _ids("cache_indirection", "batch", "beam", "cache_length"),
        _ids("encoder_padding_mask", "batch", "source_length"), *_LAYER_SELF_CACHE,
        *(Tensor(f"cross_{kind}_{LAYER}", COMPUTE, ("batch", "num_heads", "source_length", size))
          for kind, size in (("key", "head_key_dim"), ("value", "head_value_dim"))),
    ),
    (
        Tensor("logits", "float32", ("beam_rows", "vocabulary_size")),
        *(dataclasses.replace(tensor, name=f"present_{tensor.name}") for tensor in _LAYER_SELF_CACHE),
    ),
)
# The graphs of each search (`decoding.hypotheses_plan`'s `search_name`) run step by step with
# `fused_decoder_step` (`export/steps.py`): (start, update).
STEP_GRAPHS = {
    "beam": ("beam_start", "beam_update"), "sample": ("sample_start", "sample_update"),
    "greedy": ("sample_start", "greedy_update"),
}
# The graphs of the step driver, exported when the model has a fused decoder step.
STEP_DRIVER_GRAPHS = ("fused_decoder_step", *sorted({name for pair in STEP_GRAPHS.values() for name in pair}))

# Text in, text out: SentencePiece around the search (tokenized as `Translator` does).
TRANSLATE = Graph("Translator.translate, in the graph (beam size set at export)", (_TEXT,), (_TRANSLATION,))
# translate.onnx (`export/text_graph.py`): the search arguments are optional inputs.
TEXT_GRAPH = Graph(
    "SentencePiece + beam_search.onnx + SentencePiece", (_TEXT, *_SEARCH_ARGUMENTS), (_TRANSLATION,),
    optional=tuple(tensor.name for tensor in _SEARCH_ARGUMENTS),
)

# An ONNX export: graph name -> Graph; the file is `{name}.onnx` (config.json `graphs`).
# 9: a row that `patience` stopped keeps its hypotheses in beam_update, beam_hypotheses and beam_search (format
#    8's whole-search graphs let a later ended extension replace them while its batch ran on: answers
#    depended on the batch);
# 8: `ended_to_stop` without a patience is `decoding.NO_PATIENCE` (was 0), the update graph's count a
#    running sum (a format-7 reader would feed 0 to these graphs: every row would stop at its first hypotheses);
# 7: beam search's `patience` (`ended_to_stop` input of beam_update and beam_hypotheses, `ended` state);
# 6: the fused decoder step (a cache updated in place, cross-attention once per source) and each
#    search's update graph replace the step graphs; the start graphs give the source's cache;
# 5: the start and step graphs of beam search, sampling and greedy search (rows leave the batch when done);
# 4: the beam_hypotheses and sample_search graphs (n-best, target prefixes, sampling);
# 3: the whole search as one graph per search (2 had per-step update graphs);
# 2: caches heads first, [B, L, N, T, H] (1 had [B, L, T, N, H]).
ONNX = Format(
    "keras_transformer.onnx",
    9,
    {
        "encoder": ENCODE, "init_cache": INIT_CACHE, "decoder_step": DECODE_STEP,
        "greedy_search": GREEDY_SEARCH, "beam_search": BEAM_SEARCH,
        "beam_hypotheses": BEAM_HYPOTHESES, "sample_search": SAMPLE_SEARCH,
        "beam_start": BEAM_START, "beam_update": BEAM_UPDATE, "sample_start": SAMPLE_START,
        "sample_update": SAMPLE_UPDATE, "greedy_update": GREEDY_UPDATE, "fused_decoder_step": FUSED_DECODER_STEP,
    },
)
# A SavedModel export: signature name -> Graph.
# 2: caches heads first, [B, L, N, T, H] (1 had [B, L, T, N, H]).
SAVED_MODEL = Format(
    "keras_transformer.saved_model",
    2,
    {"translate": TRANSLATE, "encode": ENCODE, "init_cache": INIT_CACHE, "decode_step": DECODE_STEP},
)


def dtype(tensor, compute_dtype):
    """The tensor's dtype name, `COMPUTE` resolved to `compute_dtype`."""
    return compute_dtype if tensor.dtype == COMPUTE else tensor.dtype


def shape(tensor, sizes):
    """The tensor's shape: None for a dynamic axis, `sizes[axis]` (config.json) for a fixed one."""
    return [None if axis in DYNAMIC_AXES else int(sizes[axis]) for axis in tensor.axes]


def describe(tensor, compute_dtype):
    """`"[B, S, D] float32"`: the shape in the legend's letters and the dtype."""
    letters = ", ".join(DYNAMIC_AXES.get(axis) or FIXED_AXES[axis] for axis in tensor.axes)
    return f"[{letters}] {dtype(tensor, compute_dtype)}"


def describe_graphs(export_format, compute_dtype):
    """`{name: {"inputs": {tensor: description}, "outputs": {...}}}` for config.json."""
    return {
        name: {
            kind: {tensor.name: describe(tensor, compute_dtype) for tensor in getattr(graph, kind)}
            for kind in ("inputs", "outputs")
        }
        for name, graph in export_format.graphs.items()
    }


# ONNX Runtime's type names -> the contract's dtypes.
ONNX_RUNTIME_DTYPES = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
    "tensor(double)": "float64", "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(bool)": "bool",
    "tensor(string)": "string",
}


def check_graph_signature(session, graph, config):
    """Checks one ONNX Runtime session of `ONNX.graphs[graph]` against the contract.

    Names, dtypes, dynamic axes and the fixed axes' sizes (from the
    directory's `config`) of its inputs and outputs.
    """
    for kind, values in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
        actual = [(value.name, ONNX_RUNTIME_DTYPES.get(value.type, value.type), value.shape) for value in values]
        check_tensors(
            f"{graph}.onnx", ONNX.graphs[graph].expand(int(config["num_decoder_layers"])), kind, actual,
            config, config["cache_dtype"],
        )


def check_tensors(where, graph, kind, actual, sizes, compute_dtype):
    """Checks a graph's inputs or outputs against the contract.

    Args:
        where: str naming the graph in messages ("decoder_step.onnx").
        graph: its `Graph`.
        kind: "inputs" or "outputs".
        actual: `(name, dtype name or None, shape)` of each tensor; a dim is
            an int when fixed, a str or None when dynamic (ONNX Runtime and
            TensorFlow alike).
        sizes: the sizes of the fixed axes (config.json, or `model_fields`).
        compute_dtype: what `COMPUTE` stands for (config.json `cache_dtype`).

    Raises:
        ValidationError: naming `where`, the tensor and what differs.
    """
    expected = {tensor.name: tensor for tensor in getattr(graph, kind)}
    names = sorted(name for name, _, _ in actual)  # Names are the interface; order is not.
    if names != sorted(expected):
        raise ValidationError(f"{where} has {kind} {names}; expected {sorted(expected)}")
    for name, actual_dtype, dims in actual:
        tensor = expected[name]
        want = dtype(tensor, compute_dtype)
        if actual_dtype is not None and actual_dtype != want:
            raise ValidationError(f"{where} {name} has dtype {actual_dtype}; expected {want}")
        if len(dims) != len(tensor.axes):
            raise ValidationError(
                f"{where} {name} has rank {len(dims)} (shape {list(dims)}); expected rank {len(tensor.axes)} "
                f"{describe(tensor, compute_dtype)}"
            )
        for i, (dim, axis, size) in enumerate(zip(dims, tensor.axes, shape(tensor, sizes))):
            fixed = isinstance(dim, int) and dim >= 0
            if size is None and fixed:
                raise ValidationError(f"{where} {name} axis {i} ({axis}) is fixed to {dim}; it must be dynamic")
            if size is not None and fixed and dim != size:
                raise ValidationError(f"{where} {name} axis {i} ({axis}) is {dim}; the model's {axis} is {size}")


def numpy_dtype(tensor, compute_dtype):
    """The NumPy dtype of the tensor's arrays (object for strings)."""
    return np.dtype(_NUMPY_DTYPES.get(tensor.dtype, dtype(tensor, compute_dtype)))


def feeds(graph, values, compute_dtype):
    """The graph's inputs as NumPy arrays of the contract's dtypes, from `{name: value}`.

    Every input but the graph's `optional` ones must be given.
    """
    required = set(graph.input_names()) - set(graph.optional)
    if not required <= set(values) <= set(graph.input_names()):
        raise ValueError(f"{graph.method} takes {graph.input_names()}, received {sorted(values)}")
    return {
        tensor.name: np.asarray(values[tensor.name], numpy_dtype(tensor, compute_dtype))
        for tensor in graph.inputs
        if tensor.name in values
    }


def run(session, graph, values, compute_dtype):
    """`{output name: array}` of an ONNX Runtime session of `graph` on `{input name: value}`."""
    names = graph.output_names()
    return dict(zip(names, session.run(names, feeds(graph, values, compute_dtype))))


def hypotheses_feeds(plan, length_penalty, max_extra_length):
    """The ONNX graph and its inputs that run a `decoding.hypotheses_plan`.

    Beam search runs `beam_hypotheses`; greedy search and sampling run
    `sample_search` (greedy search is `sampling_topk` 1). Options the plan
    leaves out get the values that change nothing (no prefix: one pad
    column).

    Returns:
        `(graph name, {input name: value})`.
    """
    options, rows = plan.options, len(plan.source)
    values = {
        "encoder_token_ids": plan.source, "alpha": length_penalty, "max_extra_length": max_extra_length,
        "target_prefix": options.get("target_prefix", np.zeros((rows, 1), np.int32)),
    }
    if plan.search_name == "beam":
        values.update(
            beam_size=plan.beam_size, num_hypotheses=options["num_hypotheses"],
            ended_to_stop=options.get("ended_to_stop", NO_PATIENCE),
        )
        return "beam_hypotheses", values
    values.update(
        sample_key=options.get("sample_key", np.zeros((rows,), np.int32)), seed=options.get("seed", 0),
        sampling_topk=options.get("sampling_topk", 1), sampling_topp=options.get("sampling_topp", 1.0),
        sampling_temperature=options.get("sampling_temperature", 1.0),
    )
    return "sample_search", values


def is_export_of(format_):
    """`pathlib.Path -> bool`: whether a directory's `config.json` names `format_` (a `Format`; any version)."""

    def check(directory):
        try:
            config = json.loads((pathlib.Path(directory) / CONFIG_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and config.get("format") == format_.name

    return check


def write_config(directory, config, file=CONFIG_FILE):
    """Writes `config` as `directory/file`, JSON with sorted keys (every export's config.json)."""
    (pathlib.Path(directory) / file).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def model_fields(model):
    """The model's ids and sizes, as every export's config.json records them.

    The fixed axes' sizes (`FIXED_AXES`) are among them, so these fields
    resolve the contract's shapes for the model as config.json does for an
    exported directory.
    """
    return {
        "vocabulary_size": model.vocabulary_size,
        **{name: getattr(model, name) for name in SPECIAL_IDS},
        "hidden_dim": model.hidden_dim,
        "num_decoder_layers": len(model.decoder_layers),
        "num_heads": model.num_heads,
        "head_key_dim": model.head_key_dim,
        "head_value_dim": model.head_value_dim,
        "max_sequence_length": model.max_sequence_length,
        "cache_dtype": model.compute_dtype,
        "model_config": jsonable_config(model.get_config()),
        # Only for a model whose encoder has a table of its own: every other export's config.json is unchanged.
        **({"source_vocabulary_size": model.source_vocabulary_size}
           if getattr(model, "source_vocabulary_size", None) else {}),
    }


def tokenizer_files(tokenizer):
    """The files `tokenizer.save(directory)` writes, which every export copies beside its graphs.

    `tokenizer.model` for our shared vocabulary; source.spm, target.spm,
    vocab.json and marian_tokenizer.json for an imported Marian checkpoint's
    (`keras_transformer.tokenizers.sentencepiece.load_tokenizer` reads either back): the
    tokenizer's own `files()`.
    """
    return tuple(tokenizer.files())


def versions(*packages, optional=()):
    """`{package: version}` of keras_transformer, Keras and `packages`, for config.json.

    `optional` packages are recorded when installed.
    """
    record = {}
    for name in ("keras_transformer", "keras", *packages, *optional):
        try:
            record[name] = importlib.import_module(name).__version__
        except ImportError:
            if name not in optional:
                raise
    return record
