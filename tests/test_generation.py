"""Greedy and beam search (keras_transformer.generation) on every backend."""

import logging
import math

import keras
import numpy as np
import pytest

from conftest import BACKEND, random_ids, tiny_model, to_numpy
from keras_transformer.generation import generate, length_penalty_factor

START, END = 2, 3
LENGTHS = [7, 4, 2]  # source lengths (end id included) of the standard batch
EXTRA = 6  # max_extra_length of the standard batch: 7 + 6 + 1 <= 16 positions


@pytest.fixture(scope="module")
def model():
    """One model for the module, so compiled searches are reused across tests
    with the same shapes (batch, length buckets, beam size)."""
    return tiny_model()


@pytest.fixture
def src(rng):
    return sources(rng, LENGTHS)


def sources(rng, lengths, vocabulary_size=50):
    """Source rows `tokens + [end]` of the given lengths (end included), 0-padded."""
    ids = np.zeros((len(lengths), max(lengths)), "int32")
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = random_ids(rng, 1, n - 1, vocabulary_size)[0]
        ids[row, n - 1] = END
    return ids


def masked_log_softmax(logits):
    """What the search ranks: log-softmax with pad (0) and start (2) excluded."""
    logits = logits.astype("float64")
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs = log_probs - np.log(np.exp(log_probs).sum(-1, keepdims=True))
    log_probs[..., [0, START]] = -np.inf
    return log_probs


def full_log_probs(model, src, tgt):
    """Uncached `[B, T, V]` log-probabilities of the full model, teacher forced."""
    return masked_log_softmax(to_numpy(model({"encoder_token_ids": src, "decoder_token_ids": tgt})))


def check_rows(ids, max_lengths=None):
    """Start id, tokens without pad/start/end, one end id, then only zeros."""
    assert ids.dtype == np.int32 and ids.ndim == 2
    assert (ids[:, 0] == START).all(), ids
    for row, sequence in enumerate(ids):
        ends = np.flatnonzero(sequence == END)
        assert len(ends) == 1, sequence
        end = ends[0]
        assert not np.isin(sequence[1:end], [0, START, END]).any(), sequence
        assert (sequence[end + 1:] == 0).all(), sequence
        if max_lengths is not None:
            assert end <= max_lengths[row], (sequence, max_lengths[row])
    assert (ids[:, -1] == END).any(), "output not trimmed to the longest row"


# ---------------------------------------------------------------------- #
# Greedy search against the full (uncached) model
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_greedy_equals_teacher_forced_argmax(model, src, compile):
    max_lengths = (src > 0).sum(1) + EXTRA
    ids = generate(model, src, beam_size=1, max_extra_length=EXTRA, compile=compile)
    check_rows(ids, max_lengths)
    log_probs = full_log_probs(model, src, ids[:, :-1])  # [B, L - 1, V]
    checked = 0
    for row in range(len(src)):
        end = int(np.flatnonzero(ids[row] == END)[0])
        for t in range(1, end + 1):
            if t == max_lengths[row]:
                assert ids[row, t] == END  # forced at the maximum length
            else:
                assert ids[row, t] == log_probs[row, t - 1].argmax(), (row, t)
                checked += 1
    assert checked >= 10


def reference_greedy(model, src, max_extra_length):
    """Greedy search written out with the cached step, one row at a time.

    Rows keep the batch's padding (the model ignores it) so that every row
    has the same shapes and JAX compiles each op once.
    """
    rows = []
    buffer = src.shape[1] + max_extra_length + 1
    for row in src:
        max_length = int((row > 0).sum()) + max_extra_length
        row = row[None, :]
        cache = model.init_cache(model.encode(row), row, buffer)
        tokens = [START]
        for index in range(max_length):
            logits, cache = model.decode_step(np.array([tokens[-1]], "int32"), index, cache)
            log_probs = masked_log_softmax(to_numpy(logits))[0]
            if index + 1 == max_length:
                tokens.append(END)
            else:
                tokens.append(int(log_probs.argmax()))
            if tokens[-1] == END:
                break
        rows.append(tokens)
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], "int32")


def test_beam_size_1_is_greedy(model, src):
    expected = reference_greedy(model, src, max_extra_length=EXTRA)
    np.testing.assert_array_equal(generate(model, src, beam_size=1, max_extra_length=EXTRA), expected)
    np.testing.assert_array_equal(model.generate(src, beam_size=1, max_extra_length=EXTRA), expected)


class CacheSpy:
    """Wraps a model; at every cached step also runs the full decoder on the prefix.

    The prefix, encoder outputs and source ride in the cache (batch on axis
    0), so the search reorders them together with the keys and values.
    """

    def __init__(self, model):
        self.model = model
        self.vocabulary_size, self.pad_id, self.start_id, self.end_id = (
            model.vocabulary_size, model.pad_id, model.start_id, model.end_id)
        self.max_sequence_length = model.max_sequence_length
        self.differences = []

    def encode(self, encoder_token_ids):
        return self.model.encode(encoder_token_ids)

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        cache = self.model.init_cache(encoder_outputs, encoder_token_ids, max_length)
        batch = encoder_outputs.shape[0]
        cache["spy_prefix"] = np.zeros((batch, max_length), "int32")
        cache["spy_encoder_outputs"] = encoder_outputs
        cache["spy_source"] = encoder_token_ids
        return cache

    def decode_step(self, token_ids, index, cache):
        assert isinstance(index, int)  # the eager loop passes Python ints
        spy = {k: to_numpy(cache.pop(k)) for k in ("spy_prefix", "spy_encoder_outputs", "spy_source")}
        spy["spy_prefix"][:, index] = to_numpy(token_ids)
        logits, cache = self.model.decode_step(token_ids, index, cache)
        # The whole buffer (a fixed shape, so JAX compiles each op once): the
        # causal mask hides the positions after `index`, which are still 0.
        full = self.model.decode(spy["spy_prefix"], spy["spy_encoder_outputs"], spy["spy_source"])
        # Skip rows that already ended (greedy feeds them pad ids, which the
        # full decoder masks) and dead beams (-inf score, arbitrary tokens).
        live = ~np.isin(spy["spy_prefix"][:, 1: index + 1], [0, START, END]).any(axis=1)
        difference = np.abs(to_numpy(logits) - to_numpy(full)[:, index])[live]
        self.differences.append(float(difference.max()) if live.any() else 0.0)
        return logits, dict(cache, **spy)


# Eager JAX dispatches (and compiles) every op of the full decoder at each step: ~13 s.
@pytest.mark.parametrize("beam_size", [1, pytest.param(4, marks=[pytest.mark.slow] if BACKEND == "jax" else [])])
def test_cached_decoding_equals_uncached_during_generation(model, src, beam_size):
    spy = CacheSpy(model)
    ids = generate(spy, src, beam_size=beam_size, max_extra_length=EXTRA, compile=False)
    check_rows(ids)
    assert len(spy.differences) >= 3
    assert max(spy.differences) < 1e-5, spy.differences
    # The same tokens as the plain model.
    np.testing.assert_array_equal(ids, generate(model, src, beam_size=beam_size, max_extra_length=EXTRA))


def test_the_transposed_output_kernel_gives_the_same_logits_in_its_thread_only(model, src):
    """`transposed_output_kernel` (the whole compiled search's scope): the same step, read only inside it,
    by that model, in that thread (a search traced in one thread must not hand its tensor to another)."""
    import threading

    from keras_transformer import model as model_module

    cache = model.init_cache(model.encode(src), src, 3)
    tokens = np.full(len(src), START, "int32")
    expected, _ = model.decode_step(tokens, 0, cache)
    seen_elsewhere = []
    with pytest.raises(RuntimeError, match="inside"):
        with model.transposed_output_kernel():
            entered_model, kernel = model_module._OUTPUT_KERNEL.get()
            assert entered_model is model and tuple(kernel.shape) == (model.hidden_dim, model.vocabulary_size)
            logits, _ = model.decode_step(tokens, 0, cache)
            thread = threading.Thread(target=lambda: seen_elsewhere.append(model_module._OUTPUT_KERNEL.get()))
            thread.start()
            thread.join()
            raise RuntimeError("inside")
    assert model_module._OUTPUT_KERNEL.get() is None and seen_elsewhere == [None]
    np.testing.assert_allclose(to_numpy(logits), to_numpy(expected), rtol=1e-5, atol=1e-5)


def test_a_cache_split_per_layer_decodes_as_the_stacked_one(model, src):
    """`split_cache` (what the compiled loops carry): the same logits and keys, also after a grow."""
    stacked = model.init_cache(model.encode(src), src, 3)
    split = model.split_cache(stacked)
    assert len(split["self_key"]) == len(model.decoder_layers)
    assert tuple(split["cross_key"][0].shape) == tuple(stacked["cross_key"][:, 0].shape)
    tokens = np.full(len(src), START, "int32")
    for step in range(5):
        if step == 3:  # the positions written so far stay, in either form
            stacked, split = model.grow_cache(stacked, 5), model.grow_cache(split, 5)
        expected, stacked = model.decode_step(tokens, step, stacked)
        logits, split = model.decode_step(tokens, step, split)
        assert isinstance(split["self_key"], tuple)
        np.testing.assert_allclose(to_numpy(logits), to_numpy(expected), rtol=1e-6, atol=1e-6)
        tokens = np.argmax(to_numpy(logits), -1).astype("int32")
    for name in ("self_key", "self_value", "cross_key", "cross_value"):
        joined = np.stack([to_numpy(x) for x in split[name]], axis=1)
        np.testing.assert_allclose(joined, to_numpy(stacked[name]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        model.decode_step(tokens, 5, split)


@pytest.mark.parametrize("length_penalty", [0.0, 0.6, 1.5])
def test_beam_scores_are_full_model_log_probs_over_length_penalty(model, src, length_penalty):
    """The returned score is log P(Y|X) / lp(Y) of the returned tokens under the
    uncached model: the cache was reordered along with the beams."""
    ids, scores = generate(model, src, beam_size=4, length_penalty=length_penalty, max_extra_length=EXTRA,
                           return_scores=True)
    check_rows(ids)
    log_probs = full_log_probs(model, src, ids[:, :-1])
    for row in range(len(src)):
        end = int(np.flatnonzero(ids[row] == END)[0])
        total = sum(log_probs[row, t - 1, ids[row, t]] for t in range(1, end + 1))
        expected = total / ((5 + end) / 6) ** length_penalty
        np.testing.assert_allclose(scores[row], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- #
# A toy scorer with known probabilities (NumPy, no model)
# ---------------------------------------------------------------------- #
A, B = 4, 5
# P(next | generated prefix) over the ids [pad, unk, start, end, a, b].
TOY_TABLE = {
    (): [0.0, 0.0, 0.0, 0.30, 0.50, 0.20],
    (A,): [0.0, 0.05, 0.0, 0.20, 0.25, 0.50],
    (A, B): [0.0, 0.01, 0.0, 0.97, 0.01, 0.01],
}
TOY_DEFAULT = [0.0, 0.02, 0.0, 0.90, 0.04, 0.04]


class ToyScorer:
    """Implements the decoding protocol with NumPy; the cache holds the prefix."""

    vocabulary_size, pad_id, unk_id, start_id, end_id = 6, 0, 1, 2, 3

    def __init__(self):
        self.calls = 0

    def encode(self, encoder_token_ids):
        return np.zeros(tuple(encoder_token_ids.shape) + (1,), "float32")

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        return {"prefix": np.zeros((encoder_outputs.shape[0], max_length), "int32")}

    def decode_step(self, token_ids, index, cache):
        self.calls += 1
        prefix = np.array(to_numpy(cache["prefix"]))
        prefix[:, index] = np.reshape(to_numpy(token_ids), (-1,))
        probs = [TOY_TABLE.get(tuple(int(t) for t in row[1: index + 1]), TOY_DEFAULT) for row in prefix]
        with np.errstate(divide="ignore"):
            return np.log(np.array(probs, "float32")), {"prefix": prefix}


def toy_log_prob(*tokens):
    total, prefix = 0.0, ()
    for token in tokens:
        total += math.log(TOY_TABLE.get(prefix, TOY_DEFAULT)[token])
        prefix += (token,)
    return total


def test_length_penalty_factor_is_the_gnmt_formula():
    assert float(length_penalty_factor(1, 0.6)) == pytest.approx(1.0)
    assert float(length_penalty_factor(3, 0.6)) == pytest.approx((8 / 6) ** 0.6) == pytest.approx(1.188401, rel=1e-6)
    assert float(length_penalty_factor(10, 1.0)) == pytest.approx(2.5)
    assert float(length_penalty_factor(10, 0.0)) == pytest.approx(1.0)


def test_toy_without_length_penalty_prefers_the_short_hypothesis():
    toy = ToyScorer()
    src = np.array([[A, END]], "int32")
    ids, scores = generate(toy, src, beam_size=2, length_penalty=0.0, max_extra_length=3, return_scores=True)
    np.testing.assert_array_equal(ids, [[START, END]])
    # log 0.3 = -1.204 beats log(0.5 * 0.5 * 0.97) = -1.4168.
    assert scores[0] == pytest.approx(math.log(0.3), abs=1e-6)
    assert toy_log_prob(A, B, END) == pytest.approx(-1.416754, abs=1e-5)
    assert toy_log_prob(A, B, END) < math.log(0.3)
    # Early stop: after step 2 the best live beam (a b, log-prob -1.386) cannot
    # beat "end" (-1.204) without a penalty; the maximum length (5) is not reached.
    assert toy.calls == 2


@pytest.mark.parametrize("alpha,expected_score", [(0.6, -1.192153), (1.0, -1.062565)])
def test_toy_length_penalty_lets_the_longer_hypothesis_win(alpha, expected_score):
    toy = ToyScorer()
    src = np.array([[A, END]], "int32")
    ids, scores = generate(toy, src, beam_size=2, length_penalty=alpha, max_extra_length=3, return_scores=True)
    np.testing.assert_array_equal(ids, [[START, A, B, END]])
    # GNMT: log P / ((5 + |Y|) / 6) ** alpha, |Y| = 3 generated tokens (end included).
    assert scores[0] == pytest.approx(toy_log_prob(A, B, END) / ((5 + 3) / 6) ** alpha, abs=1e-5)
    assert scores[0] == pytest.approx(expected_score, abs=1e-5)
    assert scores[0] > math.log(0.3)  # ... beats the short hypothesis, which the penalty leaves at log 0.3
    # After step 2 the best live beam's log-prob (-1.386) is below the finished
    # "end" (-1.204): stopping there, without the length penalty in the bound,
    # would have returned the wrong hypothesis.
    assert toy.calls >= 3


@pytest.mark.parametrize("patience,calls", [(0.5, 1), (1, 2)])
def test_toy_patience_stops_once_enough_hypotheses_ended(patience, calls):
    """CTranslate2's rule: a row stops once round(K * patience) extensions ended among the K best of their step."""
    toy = ToyScorer()
    src = np.array([[A, END]], "int32")
    ids, scores = generate(
        toy, src, beam_size=2, length_penalty=0.6, max_extra_length=3, return_scores=True, patience=patience
    )
    # Step 1's two best extensions are a (0.5) and end (0.3): one ended; step 2's are a b (0.25) and b end (0.18).
    assert toy.calls == calls
    # Stopped before the exact search's a b end (score -1.192) was found: the short hypothesis (-1.204) wins.
    np.testing.assert_array_equal(ids, [[START, END]])
    assert scores[0] == pytest.approx(math.log(0.3), abs=1e-6)


def test_toy_a_row_patience_stopped_keeps_its_hypotheses_while_its_batch_runs_on():
    """A row stopped by `patience` in a batch that runs on (a longer row beside it) answers as alone.

    Row 0 stops after step 1 ("end", log 0.3: one extension ended). Row 1's target prefix keeps the batch
    going, and row 0's beams with it: by step 3 they find "a b end" (score -1.192), which would beat
    "end" (-1.204) if the stopped row's hypotheses were not kept as they were when it stopped.
    """
    from keras_transformer.generation import generate_hypotheses

    arguments = dict(beam_size=2, num_hypotheses=1, length_penalty=0.6, max_extra_length=6, patience=0.5)
    src = np.array([[A, END], [A, END]], "int32")
    alone = generate_hypotheses(ToyScorer(), src[:1], **arguments)
    np.testing.assert_array_equal(alone.sequences[0, 0, :2], [START, END])
    together = generate_hypotheses(ToyScorer(), src, target_prefix=[None, [B, A, A]], **arguments)
    np.testing.assert_array_equal(together.sequences[0, 0, :2], [START, END])
    np.testing.assert_allclose(together.scores[0], alone.scores[0], atol=1e-6)
    np.testing.assert_array_equal(together.sequences[1, 0, 1:4], [B, A, A])  # the prefix row ran on


def test_toy_large_patience_is_the_exact_search():
    src = np.array([[A, END]], "int32")
    exact, patient = ToyScorer(), ToyScorer()
    expected = generate(exact, src, beam_size=2, length_penalty=0.6, max_extra_length=3)
    found = generate(patient, src, beam_size=2, length_penalty=0.6, max_extra_length=3, patience=10)
    np.testing.assert_array_equal(found, expected)
    np.testing.assert_array_equal(found, [[START, A, B, END]])
    assert patient.calls == exact.calls


def test_toy_beam_beats_greedy():
    src = np.array([[A, END]], "int32")
    greedy, greedy_score = generate(ToyScorer(), src, beam_size=1, length_penalty=0.0, return_scores=True)
    beam, beam_score = generate(ToyScorer(), src, beam_size=2, length_penalty=0.0, return_scores=True)
    np.testing.assert_array_equal(greedy, [[START, A, B, END]])  # 0.5, then 0.5, then 0.97
    np.testing.assert_array_equal(beam, [[START, END]])
    assert greedy_score[0] == pytest.approx(toy_log_prob(A, B, END), abs=1e-5)
    assert beam_score[0] > greedy_score[0]


def test_toy_maximum_length_forces_the_end_id():
    """Ends forbidden by the scorer still appear: forced at max length = n + extra."""

    class NeverEnds(ToyScorer):
        def decode_step(self, token_ids, index, cache):
            log_probs, cache = super().decode_step(token_ids, index, cache)
            log_probs[:, END] = -np.inf  # probability 0: the end id is still forced
            return log_probs, cache

    src = np.array([[A, B, END, 0], [A, END, 0, 0]], "int32")
    for beam_size in (1, 3):
        ids = generate(NeverEnds(), src, beam_size=beam_size, max_extra_length=2)
        check_rows(ids)
        assert [int(np.flatnonzero(r == END)[0]) for r in ids] == [3 + 2, 2 + 2]


def numpy_top_k(x, k):
    """The reference: the k largest of each row, best first, ties to the lower index (stable sort)."""
    order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(x, order, axis=-1), order


@pytest.mark.parametrize("length,k", [(32000, 8), (8000, 1), (232404, 8), (30, 2), (7919, 4)])
def test_two_stage_top_k_equals_one_top_k(rng, length, k):
    """`search.common.top_k` (chunk maxima, then the chosen chunks) picks what one top-k picks, ties included."""
    from keras_transformer.search.common import _chunk_size, top_k

    assert (_chunk_size(length, k) is None) == (length in (30, 7919))  # short, or prime: one top-k
    distinct = rng.standard_normal((3, length)).astype("float32")
    ties = rng.integers(0, 4, (4, length)).astype("float32")  # each value thousands of times
    ties[1, :: 7] = -np.inf
    ties[2] = -np.inf  # a row with nothing finite (a beam search row at its forced end)
    ties[3, -1] = 9.0  # the best in the last chunk
    for x, exact in ((distinct, True), (ties, False)):
        values, indices = (to_numpy(t) for t in top_k(keras.ops.convert_to_tensor(x), k))
        want_values, want_indices = numpy_top_k(x, k)
        np.testing.assert_array_equal(values, want_values)
        assert indices.dtype == np.int32
        # Ties go to the lower index, as the backend's own top_k sends them (torch.topk does not promise it).
        if exact or BACKEND != "torch":
            np.testing.assert_array_equal(indices, want_indices)


# ---------------------------------------------------------------------- #
# Batching, compilation, limits
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("beam_size", [1, 4])
def test_batch_of_different_lengths_equals_one_by_one(model, src, beam_size):
    batch = generate(model, src, beam_size=beam_size, max_extra_length=EXTRA)
    check_rows(batch, (src > 0).sum(1) + EXTRA)
    for row in range(len(src)):
        alone = generate(model, src[row: row + 1, : (src[row] > 0).sum()], beam_size=beam_size, max_extra_length=EXTRA)
        np.testing.assert_array_equal(batch[row, : alone.shape[1]], alone[0])
        assert (batch[row, alone.shape[1]:] == 0).all()


def test_compiled_equals_eager(model, src):
    compiled, compiled_scores = generate(model, src, beam_size=4, max_extra_length=EXTRA, compile=True,
                                         return_scores=True)
    eager, eager_scores = generate(model, src, beam_size=4, max_extra_length=EXTRA, compile=False,
                                   return_scores=True)
    np.testing.assert_array_equal(compiled, eager)
    np.testing.assert_allclose(compiled_scores, eager_scores, rtol=1e-5, atol=1e-5)


class NumpyProtocol:
    """A stand-in for the ONNX Runtime wrapper: the model behind NumPy in, NumPy out.

    It has no Keras `variables`, so `generate` cannot compile its step: on
    TensorFlow and JAX it runs the hybrid driver (eager step, compiled update).
    """

    def __init__(self, model):
        self.model = model
        self.vocabulary_size, self.pad_id, self.start_id, self.end_id = (
            model.vocabulary_size, model.pad_id, model.start_id, model.end_id)
        self.max_sequence_length = model.max_sequence_length
        self.indices = []

    def encode(self, encoder_token_ids):
        return to_numpy(self.model.encode(to_numpy(encoder_token_ids)))

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        assert isinstance(max_length, int)
        cache = self.model.init_cache(to_numpy(encoder_outputs), to_numpy(encoder_token_ids), max_length)
        return {k: to_numpy(v) for k, v in cache.items()}

    def decode_step(self, token_ids, index, cache):
        self.indices.append(index)
        logits, cache = self.model.decode_step(
            to_numpy(token_ids), index, {k: to_numpy(v) for k, v in cache.items()})
        return to_numpy(logits), {k: to_numpy(v) for k, v in cache.items()}


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_numpy_protocol_object_gives_the_models_tokens(model, src, beam_size):
    """The ONNX Runtime path in miniature: same search, same tokens, Python int indices."""
    wrapper = NumpyProtocol(model)
    expected, expected_scores = generate(model, src, beam_size=beam_size, max_extra_length=EXTRA, return_scores=True)
    for compile in (True, False):
        wrapper.indices = []
        ids, scores = generate(wrapper, src, beam_size=beam_size, max_extra_length=EXTRA, compile=compile,
                               return_scores=True)
        np.testing.assert_array_equal(ids, expected)
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
        assert wrapper.indices == list(range(len(wrapper.indices))) and all(type(i) is int for i in wrapper.indices)


def test_compiled_search_sees_new_weights(src):
    model = tiny_model(seed=5)  # its own model: the test changes the weights
    before = generate(model, src, beam_size=4, max_extra_length=EXTRA)
    table = [w for w in model.weights if "token_embedding" in w.path][0]
    table.assign(to_numpy(table)[::-1] * 3.0)
    after = generate(model, src, beam_size=4, max_extra_length=EXTRA)
    np.testing.assert_array_equal(after, generate(model, src, beam_size=4, max_extra_length=EXTRA, compile=False))
    assert not np.array_equal(before, after)


@pytest.mark.slow
@pytest.mark.tensorflow_only
@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function's retracing warning")
def test_one_trace_per_length_bucket_is_not_reported_as_retracing(rng, caplog):
    # Six source-length buckets: six traces by design. TensorFlow warns from
    # the fifth trace of one tf.function within ten calls.
    model = tiny_model(seed=7, max_sequence_length=64)
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        for length in (3, 11, 19, 27, 35, 43):
            check_rows(generate(model, sources(rng, [length, 2]), beam_size=1, max_extra_length=2))
    retracing = [record.getMessage()[:120] for record in caplog.records if "retracing" in record.getMessage()]
    assert not retracing, retracing


def test_output_respects_max_sequence_length(rng):
    model = tiny_model(max_sequence_length=12, position_encoding="learned")
    src = sources(rng, [10])
    ids = generate(model, src, beam_size=2, max_extra_length=50)
    check_rows(ids)
    assert ids.shape[1] <= 12


def test_rows_are_well_formed(model, src):
    for beam_size in (1, 4):
        for extra in (0, EXTRA):
            ids = generate(model, src, beam_size=beam_size, max_extra_length=extra)
            check_rows(ids, (src > 0).sum(1) + extra)


def test_empty_batch(model):
    assert generate(model, np.zeros((0, 4), "int32")).shape == (0, 0)


# ---------------------------------------------------------------------- #
# Errors
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "bad,kwargs,match",
    [
        (np.array([[5, 50, 3]], "int32"), {}, r"token id 50, outside \[0, 50\)"),
        (np.array([[5, -2, 3]], "int32"), {}, r"token id -2, outside \[0, 50\)"),
        (np.array([5, 6, 3], "int32"), {}, r"rank 2 \[batch, length\], received shape \(3,\)"),
        (np.ones((1, 3), "float32"), {}, "integer tensor of token ids, received dtype float32"),
        (np.array([[5, 3]], "int32"), {"beam_size": 0}, "beam_size=0 must be an integer >= 1"),
        (np.array([[5, 3]], "int32"), {"beam_size": 2.0}, "beam_size=2.0 must be an integer"),
        (np.array([[5, 3]], "int32"), {"max_extra_length": -1}, "max_extra_length=-1 must be an integer >= 0"),
        (np.array([[5, 3]], "int32"), {"length_penalty": -0.5}, "length_penalty=-0.5 must be a finite number >= 0"),
        (np.array([[5, 3]], "int32"), {"length_penalty": float("nan")}, "length_penalty=nan"),
        (np.array([[5, 3]], "int32"), {"patience": 0}, r"patience=0 must be None .* or a finite number > 0"),
        (np.array([[5, 3]], "int32"), {"patience": "1"}, r"patience='1' must be None"),
    ],
    ids=["too_large", "negative", "rank", "dtype", "beam_0", "beam_float", "extra", "penalty", "penalty_nan",
         "patience_0", "patience_str"],
)
def test_bad_input_is_a_clear_error(model, bad, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, bad, **kwargs)


def test_out_of_range_ids_are_caught_for_backend_tensors(model):
    bad = keras.ops.convert_to_tensor(np.array([[5, 77, 3]], "int32"))
    with pytest.raises(ValueError, match="token id 77"):
        model.generate(bad)


def test_object_without_the_protocol_is_named():
    class Half:
        vocabulary_size, pad_id, start_id, end_id = 6, 0, 2, 3

        def encode(self, encoder_token_ids):
            return encoder_token_ids

    match = r"Half does not implement the decoding protocol: missing \['init_cache', 'decode_step'\]"
    with pytest.raises(TypeError, match=match):
        generate(Half(), np.array([[4, 3]], "int32"))

