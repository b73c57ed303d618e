"""Validation of an exported ONNX directory against the Keras model.

Its own step, as in optimum's ONNX exporter: for each graph, the input and
output names, dtypes, which axes are dynamic and the sizes of the fixed ones
(all from `export.contract`), the output shapes, and then the values
against Keras at a stated tolerance, at batch sizes and lengths other than
any the export used (the graphs are traced with unknown batch and lengths;
the shapes here are odd on purpose). A mismatch raises `ValidationError`
naming the graph, the output and the largest difference.
"""

import json
import logging
import pathlib

import numpy as np

from export import contract
from export.contract import CONFIG_FILE, ValidationError, check_graph_signature
from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID

logger = logging.getLogger(__name__)

QUANTIZATIONS = (None, "int8")

# (batch, source length, cache length) at which values are compared: none
# is a size a tracer would specialise on, and the first batch mixes lengths.
VALIDATION_SHAPES = ((3, 11, 7), (1, 5, 4))
DECODER_STEPS = 3


def _session(path):
    from export.runtime import _session_options, new_session

    # Validation is about the graph, so it runs on the CPU provider; its threads do not spin (an export
    # beside other work, e.g. the test suite's second lane, would lose a core to them).
    return new_session(path, _session_options(), ["CPUExecutionProvider"])


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
    # Non-finite values only where Keras has the same (the -inf logit of an excluded start id).
    finite = np.isfinite(expected)
    if not np.all(np.isfinite(actual[finite])) or not np.array_equal(actual[~finite], expected[~finite]):
        raise ValidationError(f"{graph}.onnx output {name} has non-finite values")
    difference = float(np.max(np.abs(actual[finite].astype(np.float64) - expected[finite]), initial=0.0))
    if atol is not None and not difference <= atol:
        raise ValidationError(
            f"{graph}.onnx output {name}: largest difference from Keras {difference:.3g} "
            f"exceeds atol={atol:g}"
        )
    return difference


def _source_ids(rng, batch, length, vocabulary_size):
    """Ordinary ids (no special one) with right padding; row i has length - 2 * i real tokens (at least 1)."""
    ids = rng.integers(FIRST_ORDINARY_ID, vocabulary_size, size=(batch, length)).astype(np.int32)
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
    directory = pathlib.Path(directory)
    config = _read_config(directory, model)
    if config.get("quantization"):
        atol = None
    sessions = _sessions(directory, config, config["graphs"])
    rng = np.random.default_rng(seed)
    differences = {}
    run, record = _runner(sessions, config, atol, differences)
    _validate_protocol_graphs(run, model, rng, record, shapes, steps)
    _validate_search_graphs(run, model, rng, record, exact=atol is not None)
    decoder_session = sessions.get("fused_decoder_step")
    if decoder_session is not None:
        _validate_fused_step(decoder_session, model, rng, record)
    _validate_hypotheses_graphs(run, model, rng, record, exact=atol is not None, sessions=sessions)
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


def check_float32_export(directory, model, atol=1e-4, shape=VALIDATION_SHAPES[0], steps=DECODER_STEPS, seed=0):
    """Checks that `directory` is a float32 export of `model`, as far as a graph it reuses needs.

    `export_onnx(..., float32_export=directory)` quantizes that export's
    graphs instead of converting the model again. Its config must be an
    unquantized one with the model's ids and sizes, and its `encoder`,
    `init_cache` and `decoder_step` must give the model's values within
    `atol` at one shape: an export of other weights (another checkpoint, a
    fine-tuned decoder) fails here, where the int8 validation, which bounds
    no value, would let it through.

    Raises:
        ValidationError: the directory is not a float32 export of `model`.
    """
    directory = pathlib.Path(directory)
    try:
        config = _read_config(directory, model)
        if config.get("quantization"):
            raise ValidationError(f"{CONFIG_FILE} has quantization={config['quantization']!r}, not float32")
        sessions = _sessions(directory, config, ("encoder", "init_cache", "decoder_step"))
        run, record = _runner(sessions, config, atol, {})
        _validate_protocol_graphs(run, model, np.random.default_rng(seed), record, (shape,), steps)
    except (ValidationError, KeyError, FileNotFoundError) as error:
        raise ValidationError(f"{directory} is not a float32 ONNX export of this model: {error}") from error


def _read_config(directory, model):
    """The directory's config.json, checked against the model's format version, ids and sizes."""
    config = json.loads((directory / CONFIG_FILE).read_text())
    expected_config = {
        "format_version": contract.ONNX.version,
        "vocabulary_size": model.vocabulary_size,
        **{name: getattr(model, name) for name in contract.SPECIAL_IDS},
        "num_decoder_layers": len(model.decoder_layers),
        "max_sequence_length": model.max_sequence_length,
        **({"source_vocabulary_size": model.source_vocabulary_size} if model.source_vocabulary_size else {}),
    }
    for key, value in expected_config.items():
        if config.get(key) != value:
            raise ValidationError(f"{CONFIG_FILE} has {key}={config.get(key)!r}; the model has {value!r}")
    return config


def _sessions(directory, config, graphs):
    """An ONNX Runtime session per graph name, each checked against the contract."""
    sessions = {}
    for graph in graphs:
        session = _session(directory / config["graphs"][graph])
        check_graph_signature(session, graph, config)
        sessions[graph] = session
    return sessions


def _runner(sessions, config, atol, differences):
    """`run(graph, **values)` and `record(graph, name, actual, expected)`, which compares and keeps the largest difference."""

    def run(graph, **values):
        return contract.run(sessions[graph], contract.ONNX.graphs[graph], values, config["cache_dtype"])

    def record(graph, name, actual, expected):
        key = f"{graph}/{name}"
        searches = (
            contract.GREEDY_SEARCH, contract.BEAM_SEARCH, contract.BEAM_HYPOTHESES, contract.SAMPLE_SEARCH,
            contract.BEAM_UPDATE, contract.SAMPLE_UPDATE, contract.GREEDY_UPDATE,
        )
        if contract.ONNX.graphs[graph] in searches:
            difference = _compare_search(graph, name, actual, expected)  # Ids equal, scores within 1e-4.
        else:
            difference = _compare(graph, name, actual, expected, atol)
        differences[key] = max(difference, differences.get(key, 0.0))

    return run, record


def _validate_protocol_graphs(run, model, rng, record, shapes, steps):
    """`encoder`, `init_cache` and `decoder_step` against the model's `encode`, `init_cache` and `decode_step`."""
    from keras import ops

    for batch, source_length, cache_length in shapes:
        ids = _source_ids(rng, batch, source_length, model.encoder_vocabulary_size)
        keras_outputs = ops.convert_to_numpy(model.encode(ids))
        record("encoder", "encoder_outputs", run("encoder", encoder_token_ids=ids)["encoder_outputs"], keras_outputs)

        # Both sides start from the Keras encoder outputs, so that each graph
        # is compared on its own.
        keras_cache = model.init_cache(keras_outputs, ids, cache_length)
        keras_cache = {name: ops.convert_to_numpy(value) for name, value in keras_cache.items()}
        onnx_cache = run("init_cache", encoder_outputs=keras_outputs, encoder_token_ids=ids, max_length=cache_length)
        for name, value in onnx_cache.items():
            record("init_cache", name, value, keras_cache[name])

        onnx_cache = dict(keras_cache)
        tokens = np.full((batch,), model.start_id, np.int32)
        for step in range(min(steps, cache_length)):
            keras_logits, keras_cache = model.decode_step(tokens, step, keras_cache)
            keras_cache = {name: ops.convert_to_numpy(value) for name, value in keras_cache.items()}
            outputs = run("decoder_step", decoder_token_ids=tokens, step=step, **onnx_cache)
            expected = {"logits": ops.convert_to_numpy(keras_logits)}
            expected.update({f"updated_{name}": keras_cache[name] for name in ("self_key", "self_value")})
            for name, value in outputs.items():
                record("decoder_step", name, value, expected[name])
            # Each side continues from its own cache, so errors may add up
            # over steps as they would in generation.
            onnx_cache = dict(
                onnx_cache, self_key=outputs["updated_self_key"], self_value=outputs["updated_self_value"]
            )
            tokens = rng.integers(FIRST_ORDINARY_ID, model.vocabulary_size, size=(batch,)).astype(np.int32)


def _validate_search_graphs(run, model, rng, record, exact):
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
        ids = _source_ids(rng, batch, source_length, model.encoder_vocabulary_size)
        ids[np.arange(batch), np.count_nonzero(ids, axis=1) - 1] = model.end_id
        arguments = {"beam_size": beam_size} if graph == "beam_search" else {}
        outputs = run(graph, encoder_token_ids=ids, alpha=0.6, max_extra_length=max_extra_length, **arguments)
        sequences, scores = outputs["sequences"], outputs["scores"]
        actual = finish_rows(sequences, model.end_id, model.pad_id)
        if not exact:
            if not (np.all(actual[:, 0] == model.start_id) and np.all(np.any(actual == model.end_id, axis=1))):
                raise ValidationError(f"{graph}.onnx returned malformed rows: {actual}")
            continue
        # Keras' search in a Python loop: the same tokens as the compiled
        # search (tests/test_generation.py), without compiling a search
        # graph per export.
        expected, expected_scores = generate(
            model, ids, beam_size=beam_size, length_penalty=0.6, max_extra_length=max_extra_length,
            return_scores=True, compile=False,
        )
        record(graph, "sequences", actual, expected)
        record(graph, "scores", scores, expected_scores)


def _validate_fused_step(session, model, rng, record, batch=3, beam_size=3, source_length=7, steps=6):
    """`fused_decoder_step` against `TransformerModel.decode_step`, logits per step.

    Beam rows reordered at random after every step (the Keras cache by a
    gather, the fused step by its `cache_indirection`), a source with
    padding, a cache that grows from 2 positions (`export.steps.FusedDecoder`).
    """
    from export.steps import FusedDecoder

    ids = _source_ids(rng, batch, source_length, model.encoder_vocabulary_size)
    cache = model.init_cache(model.encode(ids), ids, steps)
    start = {name: np.asarray(cache[name]) for name in ("cross_key", "cross_value", "encoder_padding_mask")}
    decoder = FusedDecoder(session, dict(start, buffer_length=steps), beam_size, initial_length=2)
    rows = np.repeat(np.arange(batch), beam_size)
    keras_cache = {name: np.asarray(value)[rows] for name, value in cache.items()}
    for step in range(steps):
        tokens = rng.integers(FIRST_ORDINARY_ID, model.vocabulary_size, size=(batch * beam_size,)).astype(np.int32)
        expected, keras_cache = model.decode_step(tokens, step, keras_cache)
        record("fused_decoder_step", "logits", decoder.step(tokens, step), np.asarray(expected))
        parents = rng.integers(0, beam_size, size=(batch, beam_size))
        flat = (parents + np.arange(batch)[:, None] * beam_size).reshape(-1)
        keras_cache = {
            name: np.asarray(value)[flat] if name in ("self_key", "self_value") else value
            for name, value in keras_cache.items()
        }
        decoder.reorder(parents, step)


def _validate_hypotheses_graphs(run, model, rng, record, exact, sessions=None):
    """`beam_hypotheses` and `sample_search` against `generation.generate_hypotheses`.

    Both sides run the same plan (`decoding.hypotheses_plan`); rows with and
    without a target prefix together; three best of a beam of 4; two best
    with `patience` 0.5 (rows stop once 2 hypotheses ended); three
    samples (top-k 5, top-p 0.9, temperature 0.8) and greedy search
    (`sampling_topk` 1). Where `sessions` (`{graph name: session}`) has
    the fused decoder step, each plan also runs step by step
    (`export.steps.step_search`: the start and update graphs of
    `contract.STEP_GRAPHS` around the fused decoder step, rows leaving the
    batch, a cache of 2 positions grown past several doublings, the update
    in bound buffers as the server runs it), recorded as the update graph.
    With `exact`, ids equal and scores and log-probabilities within 1e-4;
    otherwise well-formed rows.
    """
    from export.contract import STEP_GRAPHS, hypotheses_feeds
    from export.steps import step_search
    from keras_transformer.decoding import collect_hypotheses, hypotheses_plan, target_prefix_ids
    from keras_transformer.generation import generate_hypotheses

    sessions = sessions or {}
    decoder_session = sessions.get("fused_decoder_step")
    batch, source_length = 3, 9
    ids = _source_ids(rng, batch, source_length, model.encoder_vocabulary_size)
    ids[np.arange(batch), np.count_nonzero(ids, axis=1) - 1] = model.end_id
    prefixes = [list(rng.integers(FIRST_ORDINARY_ID, model.vocabulary_size, 2)), None, [FIRST_ORDINARY_ID]]
    for label, arguments in (
        ("n-best", dict(beam_size=4, num_hypotheses=3)),
        ("patience", dict(beam_size=4, num_hypotheses=2, patience=0.5)),
        ("samples", dict(beam_size=1, num_hypotheses=3, sampling_topk=5, sampling_topp=0.9,
                         sampling_temperature=0.8, seed=7)),
        ("greedy", dict(beam_size=1, num_hypotheses=1)),
    ):
        options = dict(sampling_topk=1, sampling_topp=1.0, sampling_temperature=1.0, seed=0)
        options.update({key: value for key, value in arguments.items() if key.startswith("sampling") or key == "seed"})
        plan = hypotheses_plan(
            ids, target_prefix_ids(prefixes, batch, model), arguments["beam_size"], arguments["num_hypotheses"],
            options["sampling_topk"], options["sampling_topp"], options["sampling_temperature"], options["seed"],
            arguments.get("patience"),
        )
        graph, values = hypotheses_feeds(plan, 0.6, 5)
        outputs = run(graph, **values)
        results = {graph: (outputs["sequences"], outputs["scores"], outputs["log_probs"])}
        if decoder_session is not None:
            update_name = STEP_GRAPHS[plan.search_name][1]
            results[update_name] = step_search(
                lambda name, feeds: run(name, **feeds), decoder_session, plan, 0.6, 5, initial_cache_length=2,
                update_session=sessions.get(update_name),
            )
        expected = None
        for name, result in results.items():
            actual = collect_hypotheses(plan, *result, arguments["num_hypotheses"], model)
            if not exact:
                rows = actual.sequences.reshape((-1, actual.sequences.shape[-1]))
                if not (np.all(rows[:, 0] == model.start_id) and np.all(np.any(rows == model.end_id, axis=1))):
                    raise ValidationError(f"{name}.onnx returned malformed rows ({label}): {rows}")
                continue
            if expected is None:
                expected = generate_hypotheses(  # in a Python loop, as above
                    model, ids, max_extra_length=5, length_penalty=0.6, target_prefix=prefixes, compile=False,
                    **arguments,
                )
            for output in ("sequences", "scores", "log_probs"):
                record(name, output, getattr(actual, output), getattr(expected, output))


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
