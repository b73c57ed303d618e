"""Validation of an exported ONNX directory against the Keras model.

Its own step, as in optimum's ONNX exporter: for each graph, the input and
output names, which axes are dynamic, the output shapes, and then the values
against Keras at a stated tolerance, at batch sizes and lengths other than
any the export used (the graphs are traced with unknown batch and lengths;
the shapes here are odd on purpose). A mismatch raises `ValidationError`
naming the graph, the output and the largest difference.

This module also holds the contract of an exported directory (graph, input
and output names, format version), which `export/onnx.py` writes and
`export/runtime.py` reads.
"""

import json
import logging
import pathlib

import numpy as np

logger = logging.getLogger(__name__)

# What an exported directory is, in its config.json: `format` names the kind
# (a SavedModel export has its own), `format_version` its layout.
FORMAT = "keras_transformer.onnx"
# 3: the whole search as one graph per search (2 had per-step update graphs);
# 2: caches heads first, [B, L, N, T, H] (1 had [B, L, T, N, H]).
FORMAT_VERSION = 3
CONFIG_FILE = "config.json"
QUANTIZATIONS = (None, "int8")

# Graph name -> (inputs, outputs); each maps a name to its axes, a string for
# a dynamic axis and None for a fixed one. Shape legend: B batch, S source
# length, T_max cache length, D hidden_dim, L decoder layers, N heads,
# K/Vh per-head key/value size, V vocabulary_size.
_KEY_CACHE = ("batch", None, None, "cache_length", None)  # [B, L, N, T_max, K]
_CROSS_CACHE = ("batch", None, None, "source_length", None)  # [B, L, N, S, K]
GRAPHS = {
    "encoder": (
        {"encoder_token_ids": ("batch", "source_length")},
        {"encoder_outputs": ("batch", "source_length", None)},
    ),
    "init_cache": (
        {
            "encoder_outputs": ("batch", "source_length", None),
            "encoder_token_ids": ("batch", "source_length"),
            "max_length": (),
        },
        {
            "self_key": _KEY_CACHE,
            "self_value": _KEY_CACHE,
            "cross_key": _CROSS_CACHE,
            "cross_value": _CROSS_CACHE,
            "encoder_padding_mask": ("batch", "source_length"),
        },
    ),
    "decoder_step": (
        {
            "decoder_token_ids": ("batch",),
            "step": (),
            "self_key": _KEY_CACHE,
            "self_value": _KEY_CACHE,
            "cross_key": _CROSS_CACHE,
            "cross_value": _CROSS_CACHE,
            "encoder_padding_mask": ("batch", "source_length"),
        },
        {
            "logits": ("batch", None),
            "updated_self_key": _KEY_CACHE,
            "updated_self_value": _KEY_CACHE,
        },
    ),
}
# The whole search in one graph (`generation.search_graph`): the encoder,
# the cache and an ONNX Loop over the decoder step and the search update, so
# ONNX Runtime translates a batch in one call. Rows are not trimmed
# (`keras_transformer.decoding.finish_rows` does that). L the output buffer.
_SEARCH_INPUTS = {"encoder_token_ids": ("batch", "source_length"), "alpha": (), "max_extra_length": ()}
_SEARCH_OUTPUTS = {"sequences": ("batch", "output_length"), "scores": ("batch",)}
GRAPHS["greedy_search"] = (_SEARCH_INPUTS, _SEARCH_OUTPUTS)
GRAPHS["beam_search"] = ({**_SEARCH_INPUTS, "beam_size": ()}, _SEARCH_OUTPUTS)
# The graphs running the whole search (the others are the decoding protocol's).
SEARCH_GRAPHS = ("greedy_search", "beam_search")
CACHE_KEYS = ("self_key", "self_value", "cross_key", "cross_value", "encoder_padding_mask")

# (batch, source length, cache length) at which values are compared: none
# is a size a tracer would specialise on, and the first batch mixes lengths.
VALIDATION_SHAPES = ((3, 11, 7), (1, 5, 4))
DECODER_STEPS = 3


class ValidationError(ValueError):
    """An exported graph does not match the contract or the Keras model."""


def _session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # Validation is about the graph, so it runs on the CPU provider.
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_graph_signature(session, graph):
    """Input/output names and dynamic axes of one ONNX Runtime session."""
    inputs, outputs = GRAPHS[graph]
    for kind, expected, actual in (
        ("inputs", inputs, session.get_inputs()),
        ("outputs", outputs, session.get_outputs()),
    ):
        # Names are the interface (callers pass and fetch by name); tf2onnx
        # orders dict outputs alphabetically.
        names = sorted(arg.name for arg in actual)
        if names != sorted(expected):
            raise ValidationError(f"{graph}.onnx has {kind} {names}; expected {sorted(expected)}")
        for arg in actual:
            axes = expected[arg.name]
            if len(arg.shape) != len(axes):
                raise ValidationError(
                    f"{graph}.onnx {arg.name} has rank {len(arg.shape)} (shape {arg.shape}); "
                    f"expected rank {len(axes)}"
                )
            for i, (dim, axis) in enumerate(zip(arg.shape, axes)):
                # A dynamic axis is a symbolic name or unknown in ONNX Runtime.
                if axis is not None and isinstance(dim, int):
                    raise ValidationError(
                        f"{graph}.onnx {arg.name} axis {i} ({axis}) is fixed to {dim}; it must be dynamic"
                    )


def _compare(graph, name, actual, expected, atol):
    """Largest absolute difference; raises when shapes differ or it exceeds `atol`.

    `atol=None` (quantized graphs) checks shapes and finiteness only.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise ValidationError(
            f"{graph}.onnx output {name} has shape {actual.shape}; Keras gives {expected.shape}"
        )
    if actual.dtype.kind == "b" or expected.dtype.kind == "b":
        if not np.array_equal(actual, expected):
            raise ValidationError(f"{graph}.onnx output {name} differs from Keras")
        return 0.0
    if not np.all(np.isfinite(actual)):
        raise ValidationError(f"{graph}.onnx output {name} has non-finite values")
    difference = float(np.max(np.abs(actual.astype(np.float64) - expected))) if actual.size else 0.0
    if atol is not None and not difference <= atol:
        raise ValidationError(
            f"{graph}.onnx output {name}: largest difference from Keras {difference:.3g} "
            f"exceeds atol={atol:g}"
        )
    return difference


def _source_ids(rng, batch, length, vocabulary_size):
    """Ids in [4, V) with right padding; row i has length - 2 * i real tokens (at least 1)."""
    ids = rng.integers(4, vocabulary_size, size=(batch, length)).astype(np.int32)
    for row in range(batch):
        ids[row, max(1, length - 2 * row):] = 0
    return ids


def validate_onnx(directory, model, atol=1e-4, shapes=VALIDATION_SHAPES, steps=DECODER_STEPS, seed=0):
    """Checks an exported directory against the Keras model.

    Args:
        directory: the exported directory (or its staging copy).
        model: the `TransformerModel` that was exported.
        atol: float, largest absolute difference allowed for float32 graphs.
            Quantized graphs (config `quantization` set) are checked for
            names, axes, shapes and finiteness only.
        shapes: `(batch, source_length, cache_length)` tuples to compare at.
        steps: decoder steps compared per shape (cache fed back each step).
        seed: for the random source ids.

    Returns:
        dict, the largest difference per `graph/output` (also measured,
        but not bounded, for quantized graphs).

    Raises:
        ValidationError: a name, axis, shape or value does not match.
    """
    from keras import ops

    directory = pathlib.Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    expected_config = {
        "format_version": FORMAT_VERSION,
        "vocabulary_size": model.vocabulary_size,
        "pad_id": model.pad_id,
        "start_id": model.start_id,
        "end_id": model.end_id,
        "num_decoder_layers": len(model.decoder_layers),
        "max_sequence_length": model.max_sequence_length,
    }
    for key, value in expected_config.items():
        if config.get(key) != value:
            raise ValidationError(f"{CONFIG_FILE} has {key}={config.get(key)!r}; the model has {value!r}")
    if config.get("quantization"):
        atol = None
    sessions = {}
    for graph in GRAPHS:
        session = _session(directory / config["graphs"][graph])
        check_graph_signature(session, graph)
        sessions[graph] = session

    rng = np.random.default_rng(seed)
    differences = {}

    def record(graph, name, actual, expected):
        key = f"{graph}/{name}"
        if graph in SEARCH_GRAPHS:  # Ids equal, scores within 1e-4 (float32 exports only).
            difference = _compare_search(graph, name, actual, expected)
        else:
            difference = _compare(graph, name, actual, expected, atol)
        differences[key] = max(difference, differences.get(key, 0.0))

    for batch, source_length, cache_length in shapes:
        ids = _source_ids(rng, batch, source_length, model.vocabulary_size)
        keras_outputs = ops.convert_to_numpy(model.encode(ids))
        (outputs,) = sessions["encoder"].run(["encoder_outputs"], {"encoder_token_ids": ids})
        record("encoder", "encoder_outputs", outputs, keras_outputs)

        # Both sides start from the Keras encoder outputs, so that each graph
        # is compared on its own.
        keras_cache = model.init_cache(keras_outputs, ids, cache_length)
        onnx_cache = dict(
            zip(
                CACHE_KEYS,
                sessions["init_cache"].run(
                    list(CACHE_KEYS),
                    {
                        "encoder_outputs": keras_outputs,
                        "encoder_token_ids": ids,
                        "max_length": np.array(cache_length, np.int32),
                    },
                ),
            )
        )
        for name in CACHE_KEYS:
            record("init_cache", name, onnx_cache[name], ops.convert_to_numpy(keras_cache[name]))

        keras_cache = {name: ops.convert_to_numpy(value) for name, value in keras_cache.items()}
        onnx_cache = dict(keras_cache)
        tokens = np.full((batch,), model.start_id, np.int32)
        for step in range(min(steps, cache_length)):
            keras_logits, keras_cache = model.decode_step(tokens, step, keras_cache)
            keras_cache = {name: ops.convert_to_numpy(value) for name, value in keras_cache.items()}
            logits, self_key, self_value = sessions["decoder_step"].run(
                ["logits", "updated_self_key", "updated_self_value"],
                {"decoder_token_ids": tokens, "step": np.array(step, np.int32), **onnx_cache},
            )
            record("decoder_step", "logits", logits, ops.convert_to_numpy(keras_logits))
            record("decoder_step", "updated_self_key", self_key, keras_cache["self_key"])
            record("decoder_step", "updated_self_value", self_value, keras_cache["self_value"])
            # Each side continues from its own cache, so errors may add up
            # over steps as they would in generation.
            onnx_cache = dict(onnx_cache, self_key=self_key, self_value=self_value)
            tokens = rng.integers(4, model.vocabulary_size, size=(batch,)).astype(np.int32)
    _validate_search_graphs(sessions, model, rng, record, exact=atol is not None)
    per_graph = {}
    for key, difference in differences.items():
        graph = key.split("/")[0]
        per_graph[graph] = max(difference, per_graph.get(graph, 0.0))
    logger.info(
        "Validated %s; largest difference from Keras per graph: %s",
        directory, ", ".join(f"{graph} {difference:.1e}" for graph, difference in per_graph.items()),
    )
    logger.debug("Differences per output: %s", differences)
    return differences


def _validate_search_graphs(sessions, model, rng, record, exact):
    """`greedy_search` and `beam_search` against `TransformerModel.generate`.

    Sources of mixed lengths at odd shapes, beam sizes 1 (greedy) and 3 and
    4, alpha 0.6, and a small `max_extra_length` so that rows also end at
    their maximum length. With `exact`, the trimmed ids must be equal and
    the scores within 1e-4; a quantized export (`exact=False`) must give
    well-formed rows (start id first, an end id in every row).
    """
    from keras_transformer.decoding import finish_rows
    from keras_transformer.generation import generate

    for graph, beam_size, (batch, source_length), max_extra_length in (
        ("greedy_search", 1, (3, 11), 5),
        ("beam_search", 3, (3, 11), 5),
        ("beam_search", 4, (1, 6), 50),
    ):
        ids = _source_ids(rng, batch, source_length, model.vocabulary_size)
        ids[np.arange(batch), np.count_nonzero(ids, axis=1) - 1] = model.end_id
        feeds = {
            "encoder_token_ids": ids,
            "alpha": np.array(0.6, np.float32),
            "max_extra_length": np.array(max_extra_length, np.int32),
        }
        if graph == "beam_search":
            feeds["beam_size"] = np.array(beam_size, np.int32)
        sequences, scores = sessions[graph].run(["sequences", "scores"], feeds)
        actual = finish_rows(sequences, model.end_id, model.pad_id)
        if not exact:
            if not (np.all(actual[:, 0] == model.start_id) and np.all(np.any(actual == model.end_id, axis=1))):
                raise ValidationError(f"{graph}.onnx returned malformed rows: {actual}")
            continue
        expected, expected_scores = generate(
            model, ids, beam_size=beam_size, length_penalty=0.6, max_extra_length=max_extra_length, return_scores=True
        )
        record(graph, "sequences", actual, expected)
        record(graph, "scores", scores, expected_scores)


def _compare_search(graph, name, actual, expected, atol=1e-4):
    """Search outputs: ids and flags equal, scores within `atol` (-inf where Keras has -inf)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise ValidationError(f"{graph}.onnx output {name} has shape {actual.shape}; Keras gives {expected.shape}")
    if actual.dtype.kind != "f":
        if not np.array_equal(actual, expected):
            raise ValidationError(f"{graph}.onnx output {name} differs from Keras: {actual} vs {expected}")
        return 0.0
    finite = np.isfinite(expected)
    if not np.array_equal(np.isfinite(actual), finite) or not np.array_equal(actual[~finite], expected[~finite]):
        raise ValidationError(f"{graph}.onnx output {name} has infinities where Keras does not")
    difference = float(np.max(np.abs(actual[finite].astype(np.float64) - expected[finite]), initial=0.0))
    if not difference <= atol:
        raise ValidationError(
            f"{graph}.onnx output {name}: largest difference from Keras {difference:.3g} exceeds atol={atol:g}"
        )
    return difference
