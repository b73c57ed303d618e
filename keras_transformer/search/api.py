"""Greedy and beam search over a cached decoder step: `generate` and the decoding protocol.

One search drives every model that implements the *decoding protocol*: the
Keras `TransformerModel` on TensorFlow, JAX and PyTorch, and the ONNX Runtime
wrapper in `export/runtime.py`, so both produce the same tokens.

The decoding protocol (duck typing; nothing else of the model is used):

- attributes `vocabulary_size`, `pad_id` (must be 0), `start_id`, `end_id`,
  and optionally `max_sequence_length` (generation is capped to fit it);
- `encode(encoder_token_ids [B, S] int32) -> encoder_outputs [B, S, D]`;
- `init_cache(encoder_outputs, encoder_token_ids, max_length) -> cache`: a
  dict of arrays that all have the batch on axis 0 (the search tiles and
  reorders every entry with one `ops.take(x, indices, axis=0)` and never
  looks inside); `max_length` is a Python int (a scalar int32 tensor under
  `generate_in_graph`, which traces the search for a SavedModel);
- optionally `beam_invariant_cache_keys`: the cache entries that depend on
  the source only (tiled per beam, never written by `decode_step`), which
  beam search then leaves in place instead of reordering;
- optionally `grow_cache(cache, max_length) -> cache`: the cache with room
  for `max_length` positions, the written ones kept; the compiled drivers
  then start with a short cache and grow it (`search/segments.py`);
- optionally `split_cache(cache) -> cache`: the cache as a compiled loop
  carries it (per layer; `search/loop.py`);
- optionally `transposed_output_kernel()`: a context manager entered inside
  the whole compiled search, around the loop, within which `decode_step`
  may read weights laid out for a step of a few rows (`TransformerModel`:
  the pre-softmax projection's `E^T`, made once per search);
- `decode_step(token_ids [B] int32, index, cache) -> (logits [B, V], cache)`:
  feeds the token at position `index` (0 for the start id) and returns the
  logits of position `index + 1`. `index` is a Python int, except inside
  the compiled loop used for Keras models (a scalar int32 tensor there).
- optionally `alignment_attention(encoder_token_ids [B, S], decoder_token_ids
  [B, T]) -> float32 [B, T, S]`: the aligning layer's cross-attention,
  averaged over its heads, teacher forced (`keras_transformer.documents.alignment`;
  `Translator.translate_hypotheses(return_alignment=True)` needs it), and
  `check_alignment()`, which refuses before a search where it cannot run;
- optionally `run_search(encoder_token_ids, max_lengths, alpha, beam_size,
  length) -> (sequences, scores)`: a model that runs the search loop
  itself, from the pieces of `search/loop.py` (`initial_search_state`,
  `search_step`, `search_tokens`, `search_result`). `generate` then does
  the rest (checks, lengths, padding, trimming); `compile=False` ignores it.

Arguments handed to the protocol methods are backend tensors (or, for the
very first calls, NumPy arrays); a NumPy-based implementation such as ONNX
Runtime converts them with `keras.ops.convert_to_numpy` and may return NumPy
arrays.

Shape legend: B batch, K beam size, S source length, L output buffer length
(the start id plus the generated tokens), V vocabulary size.

References:
- Vaswani et al., "Attention Is All You Need", 2017, section 6.1 (beam size
  4, length penalty alpha = 0.6, maximum output length input + 50, early
  termination when possible).
- Wu et al., "Google's Neural Machine Translation System", 2016,
  arXiv:1609.08144, section 7 (the length penalty).
- tensor2tensor's `beam_search.py` and the Flax WMT example's `decode.py`
  (the vectorised search with live and finished beams).
"""

import keras
import numpy as np
from keras import ops

from keras_transformer.checks import check_token_ids
from keras_transformer.token_ids import encoder_vocabulary_size
from keras_transformer.decoding import (
    check_search_args,
    collect_hypotheses,
    finish_rows,
    no_hypotheses,
    target_prefix_ids,
)
from keras_transformer.search import compiled, loop, segments
from keras_transformer.search.options import BEAM, call_options, refuse_hypotheses
from keras_transformer.search.common import ModelConstants, dim
from keras_transformer.search.lengths import padded_search_inputs, search_lengths

PROTOCOL_ATTRIBUTES = ("vocabulary_size", "pad_id", "start_id", "end_id", "encode", "init_cache", "decode_step")


def generate(model, encoder_token_ids, *, compile=True, return_scores=False, options=None, **search_keywords):
    """Translates source ids into target ids with greedy or beam search.

    `beam_size=1` is greedy search: the most probable token at every step,
    stopping at the end id (`length_penalty` then only affects the returned
    score). `beam_size > 1` is the paper's beam search: hypotheses are scored
    by their log-probability divided by `length_penalty_factor(|Y|, alpha)`;
    the best `2 * beam_size` extensions of the live beams are kept, those
    ending with the end id join a set of finished hypotheses and the best
    `beam_size` others stay live (as tensor2tensor). A row stops as soon as
    no live beam can beat its best finished hypothesis: a live beam's
    log-probability only decreases, and for alpha >= 0 the penalty is
    largest at the row's maximum length, so `live_log_prob / lp(max_length)`
    bounds its final score. The search stops when every row has stopped.
    With `patience`, a row of beam search also stops once
    `round(beam_size * patience)` hypotheses have ended (CTranslate2's
    rule): fewer steps, and a better hypothesis may be missed.

    Output length: row b generates at most `max_length_b = n_b +
    max_extra_length` tokens (at least 1), with n_b the number of non-pad
    ids of source row b (its end id included), i.e. per row as in the paper,
    and capped at `model.max_sequence_length - 1` when the model has one.
    At the step that reaches `max_length_b` only the end id may be chosen,
    so a hypothesis that hits the maximum length still ends with the end id
    (with its log-probability counted, floored at -1e9 when the model gives it
    probability 0). The pad and start ids are never generated.

    Compilation (`compile=True`), per backend and model:
    - a model with a `run_search` method (one that runs the search loop
      itself, e.g. in another runtime): that method, on
      every backend;
    - TensorFlow and JAX, a model exposing its Keras `variables` (a
      `TransformerModel`, or a wrapper forwarding them): the search
      (encoder, cache and a `keras.ops.while_loop` over the decoder step) is
      compiled, with `tf.function(jit_compile=True)` (XLA) or `jax.jit`,
      and cached per model. Batches of 8 rows or more of a model with
      `grow_cache` run it in segments (`search/segments.py`): rows that are
      done leave the batch and the cache grows with the output (one
      compilation per number of rows and cache length met); otherwise, or
      with `generation.SEGMENTS = False`, the whole search is one compiled
      loop, once per (batch size, source length bucket, output length
      bucket, beam size);
    - TensorFlow and JAX, any other model (e.g. one whose `decode_step`
      calls another runtime with NumPy arrays): a Python loop
      calls `decode_step` eagerly and the search's own per-step work
      (log-softmax, top-k, gathers, stopping test) as one compiled function;
    - PyTorch: a Python loop under `torch.no_grad()` (`ops.while_loop` is a
      Python loop there anyway); eager unless `TORCH_COMPILE_BACKEND` is set
      (opt-in: compiling costs about a minute per shape with "inductor" on
      a small CPU) and the model exposes its Keras `variables`: then each
      step (decoder step, search update, beam reordering, stopping test) is
      one graph, captured with `torch.export` and compiled with
      `torch.compile(backend=TORCH_COMPILE_BACKEND)` ("export": run as
      captured), once per (batch size, source length bucket, output length
      bucket, beam size) and cached per model.
    `compile=False` runs everything eagerly in a Python loop. All give the
    same tokens (compiled PyTorch code may round scores differently in the
    last bits).

    Args:
        model: an object implementing the decoding protocol (see the module
            docstring), e.g. a `TransformerModel`.
        encoder_token_ids: int `[B, S]` source ids (tokens + end id, then pad
            id 0), NumPy array or tensor.
        compile: bool. Compile the search where possible (see above);
            `False` runs eagerly. Both give the same tokens.
        return_scores: bool. Also return the score of each output row.
        options: None, or a `SearchOptions` (its fields document the
            search options).
        **search_keywords: instead of `options` (one or the other):
            `beam_size`, `length_penalty`, `max_extra_length`, `patience`,
            as in `SearchOptions`.

    Returns:
        int32 NumPy array `[B, L]`: each row is the start id, the generated
        tokens, the end id, then pad ids (0); L is the longest row. With
        `return_scores=True`, `(ids, scores)` with `scores` float32 `[B]`,
        `log P(Y | X) / lp(Y)`.

    Example:
    >>> model = TransformerModel.from_preset("tiny")
    >>> src = np.array([[5, 6, 7, 3], [8, 9, 3, 0]])
    >>> ids = generate(model, src, beam_size=4)
    >>> ids[:, 0]
    array([2, 2], dtype=int32)
    """
    check_protocol(model)
    options = call_options("generate", options, search_keywords, BEAM)
    refuse_hypotheses(options, "generate", "generate_hypotheses")
    if options.patience is not None and options.beam_size > 1:  # the option is the n-best search's
        best = generate_hypotheses(model, encoder_token_ids, compile=compile, options=options)
        sequences = finish_rows(best.sequences[:, 0], model.end_id, model.pad_id)
        return (sequences, best.scores[:, 0]) if return_scores else sequences
    encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", encoder_vocabulary_size(model))
    if model.pad_id != 0:
        raise ValueError(f"pad_id={model.pad_id}: only 0 is supported (masks are built from ids > 0)")
    source = np.asarray(ops.convert_to_numpy(encoder_token_ids)).astype("int32")
    batch, source_length = source.shape
    if batch == 0:
        empty = np.zeros((0, 0), "int32")
        return (empty, np.zeros((0,), "float32")) if return_scores else empty

    max_lengths, length, padded_length = search_lengths(
        source, options.max_extra_length, getattr(model, "max_sequence_length", None)
    )
    max_lengths = np.asarray(ops.convert_to_numpy(max_lengths)).astype("int32")  # [B]
    length = int(ops.convert_to_numpy(length))  # L
    padded_length = int(ops.convert_to_numpy(padded_length))
    source = np.pad(source, ((0, 0), (0, padded_length - source_length)))  # [B, S_bucket]

    search = select_driver(model, compile)
    sequences, scores, _ = search(
        model,
        ops.convert_to_tensor(source, "int32"),
        ops.convert_to_tensor(max_lengths, "int32"),
        ops.convert_to_tensor(float(options.length_penalty), "float32"),
        int(options.beam_size),
        length,
    )
    sequences = finish_rows(np.asarray(ops.convert_to_numpy(sequences))[:, 0], model.end_id, model.pad_id)
    if return_scores:
        return sequences, np.asarray(ops.convert_to_numpy(scores))[:, 0].astype("float32")
    return sequences


def generate_hypotheses(
    model, encoder_token_ids, *, target_prefix=None, compile=True, options=None, **search_keywords
):
    """The `num_hypotheses` best outputs per source row, with their scores and log-probabilities.

    The search of `generate`, with three options:

    - n-best: beam search keeps searching until no live beam can enter a
      row's `num_hypotheses` best finished hypotheses (with one, exactly
      `generate`'s search), and returns them best first; the first is
      `generate`'s output. Distinct by construction (distinct paths).
      Greedy search (`beam_size=1`) has one.
    - `target_prefix`: every output of row b starts with its prefix's
      tokens, and the search continues from there (the token rule of
      `search/log_probs.py` excludes every other id inside the prefix; the
      prefix's tokens keep their log-probabilities, so scores are the
      model's log-probabilities of the whole output). Row b may generate at
      least its prefix and the end id.
    - sampling (`sampling_topk != 1`, with `beam_size=1`): greedy search
      with each token drawn (`search/sample.py`) from the
      `sampling_temperature`-tempered distribution cut to its
      `sampling_topk` most probable ids (0: all) and to the smallest set
      holding `sampling_topp` of the probability; `num_hypotheses` samples
      per row (sample i of a row draws with its own noise), sorted by
      score. The draw is a function of (`seed`, step, the row's source
      tokens and sample number, token id) only: the same seed gives the
      same samples on every backend, in the exported ONNX graph, and in
      any batch. `sampling_topk=1` is
      greedy search.

    Args:
        model, encoder_token_ids, compile: as `generate`.
        target_prefix: None, or per source row None or a list of token ids
            (no start or end id), or an int array `[B, P]` padded with the
            pad id; at most `model.max_sequence_length - 2` tokens.
        options: None, or a `SearchOptions` (its fields document the
            search options); its `num_hypotheses` None is 1.
        **search_keywords: instead of `options` (one or the other): any
            `SearchOptions` field (`beam_size`, `num_hypotheses`,
            `sampling_topk`, ...). With `patience`, a row of beam search
            also stops once it holds `num_hypotheses`.

    Returns:
        `decoding.Hypotheses(sequences, scores, log_probs)`: int32
        `[B, num_hypotheses, L]` (rows as `generate`'s), float32
        `[B, num_hypotheses]` twice; best first.

    Raises:
        ValueError: naming the argument, as `generate`, and for
            `num_hypotheses > beam_size` (without sampling), a negative
            `sampling_topk`, a temperature <= 0, sampling with
            `beam_size > 1`, or a bad or too long prefix.

    Example:
    >>> best = generate_hypotheses(model, src, beam_size=4, num_hypotheses=3)
    >>> best.sequences.shape[:2], best.scores.shape
    ((2, 3), (2, 3))
    """
    check_protocol(model)
    options = call_options("generate_hypotheses", options, search_keywords)
    encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", encoder_vocabulary_size(model))
    if model.pad_id != 0:
        raise ValueError(f"pad_id={model.pad_id}: only 0 is supported (masks are built from ids > 0)")
    source = np.asarray(ops.convert_to_numpy(encoder_token_ids)).astype("int32")
    prefix = target_prefix_ids(target_prefix, source.shape[0], model)
    if source.shape[0] == 0:
        return no_hypotheses(options.count)
    plan = options.plan(source, prefix)
    prefix = plan.options.get("target_prefix")
    max_lengths, length, padded_length = search_lengths(
        plan.source, options.max_extra_length, getattr(model, "max_sequence_length", None), prefix
    )
    length = int(ops.convert_to_numpy(length))
    padded_length = int(ops.convert_to_numpy(padded_length))
    source = np.pad(plan.source, ((0, 0), (0, padded_length - plan.source.shape[1])))
    search = select_driver(model, compile, own_search=False)
    outputs = search(
        model,
        ops.convert_to_tensor(source, "int32"),
        ops.convert_to_tensor(np.asarray(ops.convert_to_numpy(max_lengths)).astype("int32"), "int32"),
        ops.convert_to_tensor(float(options.length_penalty), "float32"),
        plan.beam_size,
        length,
        plan.search_name,
        {name: ops.convert_to_tensor(value) for name, value in plan.options.items()},
    )
    return collect_hypotheses(
        plan, *(np.asarray(ops.convert_to_numpy(x)) for x in outputs), num_hypotheses=options.count, model=model
    )


def generate_in_graph(model, encoder_token_ids, beam_size=4, length_penalty=0.6, max_extra_length=50):
    """`generate` inside a TensorFlow graph: symbolic ids in, symbolic ids out.

    For exporting the search (`export/saved_model.py`): called while an
    enclosing `tf.function` is traced, with ids of unknown batch and length.
    The lengths (`max_length_b`, the buffer length L, the padded source
    length) are computed as `generate` computes them, but as tensors, and
    the search is the same compiled function that `generate` runs
    (`tf.function(jit_compile=TF_JIT_COMPILE)`, cached per model); under XLA
    the tensor L is a compile-time constant, so it is compiled once per
    (batch, source bucket, L, beam size), as `generate` is.

    Args:
        model: a `TransformerModel` (or a protocol object exposing its Keras
            `variables`).
        encoder_token_ids: int `[B, S]` symbolic tensor, tokens + end id then
            pad id 0; B >= 1.
        beam_size, length_penalty, max_extra_length: as in `generate`
            (Python numbers, fixed in the graph).

    Returns:
        `(sequences, scores)`: int32 `[B, L]`, each row the start id, the
        generated tokens, the end id, then pad ids (not trimmed to the
        longest row, as `generate` does); float32 `[B]`.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "generate_in_graph builds a TensorFlow graph; KERAS_BACKEND is "
            f"{keras.backend.backend()!r}. Run with KERAS_BACKEND=tensorflow."
        )
    check_protocol(model)
    check_search_args(beam_size, length_penalty, max_extra_length)
    if not isinstance(getattr(model, "variables", None), (list, tuple)):
        raise TypeError(
            f"generate_in_graph needs a model exposing its Keras variables, received {type(model).__name__}"
        )
    if model.pad_id != 0:
        raise ValueError(f"pad_id={model.pad_id}: only 0 is supported (masks are built from ids > 0)")
    source, max_lengths, length = padded_search_inputs(
        encoder_token_ids, max_extra_length, getattr(model, "max_sequence_length", None)
    )
    search = compiled.compiled_search(model)
    sequences, scores, _ = search(
        model, source, max_lengths, ops.convert_to_tensor(float(length_penalty), "float32"), int(beam_size), length
    )
    return sequences[:, 0], scores[:, 0]


def search_graph(model, search_name):
    """The whole search as one function of tensors, to export as one graph.

    For `export/onnx.py`, which converts it (traced with unknown batch and
    source length, without XLA) into one ONNX graph: the `keras.ops.while_loop`
    over the decoder step becomes an ONNX `Loop` with the caches as its state,
    so ONNX Runtime runs a whole search per call with this package's code. The
    lengths and the source padding are computed as `generate` computes them.

    Args:
        model: a `TransformerModel`.
        search_name: "greedy" or "beam" (for beams, `beam_size` is an
            input, so one graph serves every beam size).

    Returns:
        A function `(encoder_token_ids [B, S] int32, beam_size [] int32,
        alpha [] float32, max_extra_length [] int32) -> (sequences [B, L]
        int32, scores [B] float32)`, rows not trimmed (see
        `decoding.finish_rows`); greedy search ignores `beam_size`.
    """
    check_search_name(search_name)
    limit = getattr(model, "max_sequence_length", None)

    def search(encoder_token_ids, beam_size, alpha, max_extra_length):
        source, max_lengths, length = padded_search_inputs(encoder_token_ids, max_extra_length, limit)
        if search_name == "greedy":
            beam_size = 1
        sequences, scores, _ = loop.run(
            model, source, max_lengths, alpha, beam_size, length, compiled=True, search_name=search_name
        )
        return sequences[:, 0], scores[:, 0]

    return search


def hypotheses_graph(model, search_name):
    """The search of `generate_hypotheses` as one function of tensors, to export as one graph.

    As `search_graph`, with the search's options as inputs: the exported
    `beam_hypotheses` and `sample_search` graphs (`export/onnx.py`), which
    `export.runtime.OnnxSeq2Seq.generate_hypotheses` runs after the same
    `decoding.hypotheses_plan` as `generate_hypotheses`.

    Args:
        model: a `TransformerModel`.
        search_name: "beam" or "sample" (greedy search is sampling with
            `sampling_topk` 1).

    Returns:
        A function `(encoder_token_ids [B, S] int32, beam_size [] int32,
        alpha [] float32, max_extra_length [] int32, options) ->
        (sequences [B, K, L] int32, scores [B, K] float32, log_probs [B, K]
        float32)`; `options` a dict of tensors named as in
        `decoding.hypotheses_plan` (`target_prefix` int32 `[B, P]`, P >= 1,
        pad-filled; beam: `num_hypotheses`, `ended_to_stop`; sample: `sample_key`, `seed`,
        `sampling_topk`, `sampling_topp`, `sampling_temperature`). K is the
        beam size (1 for sampling); rows are not trimmed.
    """
    if search_name not in ("beam", "sample"):
        raise ValueError(f"search_name={search_name!r} must be 'beam' or 'sample'")
    limit = getattr(model, "max_sequence_length", None)

    def search(encoder_token_ids, beam_size, alpha, max_extra_length, options):
        source, max_lengths, length = padded_search_inputs(
            encoder_token_ids, max_extra_length, limit, options["target_prefix"]
        )
        if search_name == "sample":
            beam_size = 1
        return loop.run(
            model, source, max_lengths, alpha, beam_size, length, compiled=True, search_name=search_name,
            options=options,
        )

    return search


def start_graph(model, search_name):
    """The start of a search run step by step, as one function of tensors, to export as one graph.

    For the ONNX Runtime step driver (`export/steps.py`), which runs this
    once and then the fused decoder step and `update_graph` per step,
    dropping rows that are done from the batch: the lengths and source
    padding of `generate`, the encoder, the source's part of the cache
    (`init_cache`'s cross-attention keys and values and padding mask, once
    per source: the driver's decoder step reads them for every beam of a
    row) and the search's `init`.

    Args:
        model: a `TransformerModel`.
        search_name: "greedy", "beam" or "sample".

    Returns:
        A function `(encoder_token_ids [B, S] int32, beam_size [] int32,
        max_extra_length [] int32, options) -> dict`: the search state's
        fields that change (`Field.constant` False), `decoder_token_ids`
        (`[B * K]`, the ids to feed at index 0), the cache entries
        `beam_invariant_cache_keys` (`[B, ...]`), `max_lengths` int32 `[B]`
        and `buffer_length` (L, int32 scalar). `options` as
        `hypotheses_graph`'s; greedy search and sampling ignore `beam_size`.
    """
    check_search_name(search_name)
    limit = getattr(model, "max_sequence_length", None)
    search = loop.SEARCHES[search_name]

    def search_start(encoder_token_ids, beam_size, max_extra_length, options):
        source, max_lengths, length = padded_search_inputs(
            encoder_token_ids, max_extra_length, limit, options["target_prefix"]
        )
        if search_name != "beam":
            beam_size = 1
        index = ops.convert_to_tensor(0, "int32")
        cache = model.init_cache(model.encode(source), source, 1)
        source_cache = {name: cache[name] for name in loop.beam_invariant_keys(model)}
        state, _ = search.init(model, dim(source, 0), beam_size, length, index, {}, options)
        outputs = {field.name: state[field.name] for field in search.STATE_SPEC if not field.constant}
        return dict(
            outputs, **source_cache, decoder_token_ids=search.tokens(state), max_lengths=max_lengths,
            buffer_length=ops.cast(length, "int32"),
        )

    return search_start


def update_graph(model, search_name):
    """A search's work between two decoder steps, as one function of tensors, to export as one graph.

    For the ONNX Runtime step driver (`export/steps.py`), which runs the
    decoder step itself (`export/fused_step.py`): the search's `update` of
    the step's logits, the ids to feed next, and the search's `rows_done`,
    `keep_going` and `hypotheses` of the new state: a driver hands out the
    hypotheses of the rows that are done (they no longer change) and keeps
    stepping the others. Beam search also returns each new beam's parent,
    by which the driver reorders its cache.

    Args:
        model: a `TransformerModel` (read for its ids and vocabulary size).
        search_name: "greedy", "beam" or "sample".

    Returns:
        A function `(state, logits [B * K, V] float32, max_lengths [B]
        int32, alpha [] float32, buffer_length [] int32) -> dict` of `state`
        (the new state's fields that change, `Field.constant` False),
        `decoder_token_ids` (`[B * K]`), `parents` (beam search: int32
        `[B, K]`, the beam each new beam continues), `rows_done` (bool
        `[B]`), `keep_going` (bool scalar) and `hypotheses` (`(sequences
        [B, K, L], scores [B, K], log_probs [B, K])`, K 1 for sampling).
        `state` holds every field of the search's `STATE_SPEC`.
    """
    check_search_name(search_name)
    search = loop.SEARCHES[search_name]
    constants = ModelConstants(model)

    def search_update(state, logits, max_lengths, alpha, buffer_length):
        state, parents = search.update(constants, state, logits, max_lengths, alpha)
        outputs = {
            "state": {field.name: state[field.name] for field in search.STATE_SPEC if not field.constant},
            "decoder_token_ids": search.tokens(state),
            "rows_done": search.rows_done(state, max_lengths, alpha),
            "keep_going": search.keep_going(state, max_lengths, alpha, buffer_length),
            "hypotheses": search.hypotheses(state),
        }
        if parents is not None:
            outputs["parents"] = ops.cast(parents, "int32")
        return outputs

    return search_update


def check_search_name(search_name):
    """Refuses a search name that is not one of `search/loop.py`'s searches."""
    if search_name not in loop.SEARCHES:
        raise ValueError(f"search_name={search_name!r} must be one of {sorted(loop.SEARCHES)}")


def check_protocol(model):
    """Refuses a model that lacks a method or attribute of the decoding protocol."""
    missing = [name for name in PROTOCOL_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not implement the decoding protocol: missing {missing}. "
            "See keras_transformer.generation for the protocol."
        )



def select_driver(model, compile, own_search=True):
    """The driver for `model`: its own, compiled, hybrid or eager (see `generate`).

    `own_search=False`: never the model's `run_search` (which runs
    `generate`'s search only).
    """
    backend = keras.backend.backend()
    if own_search and compile and callable(getattr(model, "run_search", None)):
        return model_search
    has_variables = isinstance(getattr(model, "variables", None), (list, tuple))
    if compile and backend == "torch" and compiled.TORCH_COMPILE_BACKEND is not None and has_variables:
        return compiled.torch_step_search
    if not compile or backend not in ("jax", "tensorflow"):
        return loop.run_eager
    if has_variables and compiled.SEGMENTS and segments.supports(model):
        return compiled.segmented_search(model)
    if has_variables:
        return compiled.compiled_search(model)
    return compiled.hybrid_search


def model_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length):
    """The driver of a model that runs the search itself (`run_search`): its best hypotheses, K = 1."""
    sequences, scores = model.run_search(encoder_token_ids, max_lengths, alpha, beam_size, length)
    return ops.expand_dims(sequences, 1), ops.expand_dims(scores, 1), None
