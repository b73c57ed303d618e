"""Teacher-forced scoring (search/scoring.py, Translator.score) on every backend.

The score of a target is the log-probability the search gives it: the twin
token rules (keras.ops and NumPy) agree, scoring greedy search's output gives
greedy search's own log-probability, and the per-token values equal a plain
NumPy log-softmax of the full (uncached) model's logits.
"""

import types

import keras
import numpy as np
import pytest

from conftest import random_ids, tiny_model, to_numpy
from keras_transformer.generation import generate, length_penalty_factor
from keras_transformer.search.log_probs import (
    FORCED_END_LOG_PROB,
    best_token,
    token_log_probs,
    token_log_probs_numpy,
)
from keras_transformer.search.scoring import score_targets
from keras_transformer.tokenizers.sentencepiece import train_tokenizer
from keras_transformer.translator import TargetScore, Translator
from test_translator import SENTENCES

PAD, START, END = 0, 2, 3
EXTRA = 6
TEXTS = ["Nobody sees it!", "The old owner paints the big garden.", "A student finds two cats.", "Our children."]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SENTENCES, vocabulary_size=120)


def sources(rng, lengths, vocabulary_size=50):
    """Source rows `tokens + [end]` of the given lengths (end included), 0-padded."""
    ids = np.zeros((len(lengths), max(lengths)), "int32")
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = random_ids(rng, 1, n - 1, vocabulary_size)[0]
        ids[row, n - 1] = END
    return ids


def log_softmax(logits):
    logits = np.asarray(logits, "float64")
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


class SoftCopyModel:
    """Decoding protocol in NumPy: at position t, the source's token t is the most probable, by a margin.

    Every other id gets a fixed pseudo-random logit, so log-probabilities
    are not trivial; greedy search copies the source (the end id where the
    source has padding), which the tokenizer's pieces give back exactly.
    """

    pad_id, unk_id, start_id, end_id = 0, 1, 2, 3

    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size
        self.noise = np.random.default_rng(5).uniform(0.0, 2.0, (256, vocabulary_size)).astype("float32")

    def encode(self, encoder_token_ids):
        return np.zeros(tuple(encoder_token_ids.shape) + (1,), "float32")

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        return {"source": to_numpy(encoder_token_ids)}

    def decode_step(self, token_ids, index, cache):
        source = to_numpy(cache["source"])
        index = int(to_numpy(index))
        target = source[:, min(index, source.shape[1] - 1)]
        logits = np.tile(self.noise[index], (source.shape[0], 1))
        logits[np.arange(len(target)), np.where(target > 0, target, self.end_id)] += 3.0
        return logits, {"source": source}


# ---------------------------------------------------------------------- #
# The token rule: keras.ops and NumPy twins
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("shape", [(4, 50), (3, 2, 50)])
def test_the_twin_token_rules_agree(model, shape):
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 4.0, shape).astype("float32")
    logits[0, ..., 7] = -np.inf  # an id the model rules out
    logits[1, ..., END] = -1e30  # the end id with probability 0 where it is forced
    max_lengths = np.array([5, 3, 9, 3][: shape[0]], "int32")
    for generated_length in (1, 3, 5):
        expected = token_log_probs_numpy(model, logits, generated_length, max_lengths)
        actual = to_numpy(token_log_probs(model, keras.ops.convert_to_tensor(logits), generated_length,
                                          keras.ops.convert_to_tensor(max_lengths)))
        assert actual.dtype == expected.dtype == np.float32
        np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-5)
    # The rule itself: pad and start never; at the maximum length (row 1 at length 3) only the end id,
    # floored where the model gives it probability 0; elsewhere the log-softmax over the whole vocabulary.
    rule = token_log_probs_numpy(model, logits, 3, max_lengths)
    assert np.isneginf(rule[..., [PAD, START]]).all()
    assert np.isneginf(np.delete(rule[1], END, axis=-1)).all()
    assert (rule[1, ..., END] == np.float32(FORCED_END_LOG_PROB)).all()
    np.testing.assert_allclose(rule[2, ..., 3:], log_softmax(logits[2])[..., 3:], rtol=1e-5)


@pytest.mark.parametrize("ids", [(0, 2, 3, 50), (0, 2, 3, 4096), (4095, 4095, 0, 4096)],
                         ids=["tiny", "long-vocabulary", "marian-ids"])
def test_greedy_best_token_is_the_first_best_of_the_token_rule(ids):
    pad, start, end, vocabulary_size = ids
    model = types.SimpleNamespace(pad_id=pad, start_id=start, end_id=end, vocabulary_size=vocabulary_size)
    rng = np.random.default_rng(3)
    batch = 12
    logits = rng.normal(0.0, 4.0, (batch, vocabulary_size)).astype("float32")
    logits[0, 7] = -np.inf  # an id the model rules out
    logits[1, end] = -1e30  # the end id with probability 0 where it is forced
    logits[3, [5, 9]] = logits[3].max() + 1.0  # a tie: the first id wins
    logits[4, [pad, start]] = logits[4].max() + 5.0  # excluded ids would win
    # At the maximum length: rows 1, 3, 5 at generated length 3; 6, 7, 9, 11 at 2.
    max_lengths = np.array([5, 3, 9, 3, 4, 3, 2, 2, 8, 2, 9, 2], "int32")
    # Forced ids at positions 1-2 (columns 0-1), pad-filled: an ordinary id, the end id at the
    # maximum length, another id there (no id allowed), the start id, the pad id (forces nothing).
    prefix = np.full((batch, 2), pad, "int32")
    prefix[5:12, 1] = [9, end, 11, 6, end, start, pad]
    prefix[8, 0] = 12
    for generated_length, target_prefix in [(1, None), (3, None), (3, prefix), (2, prefix), (1, prefix)]:
        args = (keras.ops.convert_to_tensor(logits), generated_length, keras.ops.convert_to_tensor(max_lengths))
        if target_prefix is not None:
            args += (keras.ops.convert_to_tensor(target_prefix),)
        rule = to_numpy(token_log_probs(model, *args))
        expected_log_probs = rule.max(axis=1)
        expected_ids = rule.argmax(axis=1)  # the first of equal values, as top_k
        log_probs, best = (to_numpy(x) for x in best_token(model, *args))
        assert best.dtype == np.int32 and log_probs.dtype == np.float32
        rows = np.arange(batch) != (3 if keras.backend.backend() == "torch" else -1)  # torch.topk: ties unordered
        np.testing.assert_array_equal(best[rows], expected_ids[rows], err_msg=f"length {generated_length}")
        np.testing.assert_array_equal(log_probs, expected_log_probs, err_msg=f"length {generated_length}")
        if generated_length == 3 and target_prefix is None:  # the cases are there
            assert best[1] == end and log_probs[1] == np.float32(FORCED_END_LOG_PROB)
            assert best[3] == end and best[4] not in (pad, start)
        if generated_length == 2 and target_prefix is not None:
            assert [best[5], best[6], best[8], best[9], best[11]] == [9, end, 6, end, end]
            no_id = [7] if start == pad else [7, 10]  # a start id that is the pad id forces nothing
            assert np.isneginf(log_probs[no_id]).all() and (best[no_id] == 0).all()
            assert np.isfinite(log_probs[[5, 6, 8, 9, 11]]).all()


# ---------------------------------------------------------------------- #
# score_targets over the decoding protocol
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("length_penalty", [0.0, 0.6])
def test_the_score_of_greedy_output_is_greedy_search_own_log_probability(model, length_penalty):
    src = sources(np.random.default_rng(1), [7, 4, 2, 5])
    ids, scores = generate(model, src, beam_size=1, length_penalty=length_penalty, max_extra_length=EXTRA,
                           return_scores=True)
    log_probs, token_log_probs = score_targets(model, src, ids)
    lengths = (ids[:, 1:] != PAD).sum(axis=1)
    penalty = to_numpy(length_penalty_factor(lengths, length_penalty))
    np.testing.assert_allclose(log_probs / penalty, scores, rtol=1e-5, atol=1e-4)
    assert token_log_probs.shape == (4, ids.shape[1] - 1)
    np.testing.assert_array_equal(token_log_probs[np.arange(ids.shape[1] - 1)[None, :] >= lengths[:, None]], 0.0)
    np.testing.assert_allclose(token_log_probs.sum(axis=1), log_probs, rtol=1e-6, atol=1e-5)


def test_token_scores_equal_a_numpy_log_softmax_of_the_full_models_logits(model):
    rng = np.random.default_rng(2)
    src = sources(rng, [6, 3, 9])
    ids = generate(model, src, beam_size=2, max_extra_length=4)
    # Not only searched outputs: any target, and one that ends at once.
    other = np.zeros_like(ids)
    other[:, 0] = START
    other[0, 1:4] = random_ids(rng, 1, 3)[0]
    other[0, 4] = END
    other[1, 1] = END
    other[2, 1: ids.shape[1] - 1] = random_ids(rng, 1, ids.shape[1] - 2)[0]
    other[2, -1] = END
    for target in (ids, other):
        log_probs, token_log_probs = score_targets(model, src, target)
        logits = to_numpy(model({"encoder_token_ids": src, "decoder_token_ids": target[:, :-1]}))  # uncached
        expected = np.take_along_axis(log_softmax(logits), target[:, 1:, None], axis=-1)[..., 0]  # [B, T - 1]
        lengths = np.argmax(target[:, 1:] == END, axis=1) + 1
        expected[np.arange(target.shape[1] - 1)[None, :] >= lengths[:, None]] = 0.0
        np.testing.assert_allclose(token_log_probs, expected, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(log_probs, expected.sum(axis=1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "target, match",
    [
        ([[5, 6, END]], "row 0 starts with id 5, not the start id 2"),
        ([[START, 5, 6]], "row 0 has no end id"),
        ([[START, 5, PAD, END]], "row 0 holds id 0 at position 2, before its end id"),
        ([[START, START, END]], "row 0 holds id 2 at position 1"),
        ([[START, 50, END]], r"decoder_token_ids contains token id 50, outside \[0, 50\)"),
        ([START, END], r"decoder_token_ids must have rank 2 \[batch, length\], received shape \(2,\)"),
        ([[START, END], [START, END]], "encoder_token_ids has 1 rows but decoder_token_ids has 2"),
        ([[START] + [5] * 64 + [END]], "row 0 has 65 tokens .* at most max_sequence_length=64"),
    ],
)
def test_score_targets_refuses_rows_that_are_not_start_tokens_end(model, target, match):
    with pytest.raises(ValueError, match=match):
        score_targets(model, np.array([[5, 6, END]]), np.array(target))


# ---------------------------------------------------------------------- #
# Translator.score
# ---------------------------------------------------------------------- #
def test_translator_score_of_a_greedy_translation_is_greedy_search_own_log_probability(tokenizer):
    """Text in, text out, text scored: with a model whose greedy output is its tokenizer's own pieces."""
    engine = SoftCopyModel(tokenizer.vocabulary_size)
    translator = Translator(engine, tokenizer)
    translations = translator.translate(TEXTS, beam_size=1)
    assert translations == TEXTS  # it copies, so the texts give back the searched pieces
    scores = translator.score(TEXTS, translations, batch_size=3)
    src = np.zeros((len(TEXTS), 16), "int32")
    for row, ids in enumerate(translator.encode(TEXTS)):
        src[row, : len(ids)] = ids
    ids, greedy = generate(engine, src, beam_size=1, length_penalty=0.0, return_scores=True)
    np.testing.assert_allclose([score.log_prob for score in scores], greedy, rtol=1e-5, atol=1e-5)
    for row, score in enumerate(scores):
        assert isinstance(score, TargetScore)
        assert score.token_ids == [int(i) for i in ids[row, 1:] if i != PAD]
        assert len(score.token_log_probs) == len(score.token_ids)
        assert score.log_prob == pytest.approx(sum(score.token_log_probs), abs=1e-5)
        assert all(value < 0 for value in score.token_log_probs)


def test_translator_scores_in_any_batches_and_an_empty_target(tokenizer):
    translator = Translator(tiny_model(vocabulary_size=tokenizer.vocabulary_size, seed=3), tokenizer)
    targets = ["Niemand sieht es!", "", "Der alte Besitzer.", "Zwei Katzen."]
    together = translator.score(TEXTS, targets, batch_size=4)
    apart = translator.score(TEXTS, targets, max_batch_tokens=1)
    for a, b in zip(together, apart):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.token_log_probs, b.token_log_probs, rtol=1e-5, atol=1e-5)
    assert together[1].token_ids == [END] and len(together[1].token_log_probs) == 1  # "" scores the end token
    assert together[0].token_ids == tokenizer.encode(targets[0], add_end=True, target=True)[0]


def test_translator_score_refuses_bad_input_in_one_line(tokenizer):
    translator = Translator(SoftCopyModel(tokenizer.vocabulary_size), tokenizer)
    cases = [
        ((["a", "b"], ["x"]), {}, ValueError, "sources has 2 texts but targets has 1; score needs one target per"),
        ((["a", "  "], ["x", "y"]), {}, ValueError, r"sources\[1\] is empty; score needs a non-empty source"),
        ((["a"], [3]), {}, TypeError, r"targets\[0\] must be a str, received int"),
        ((["a"], ["x"]), {"max_batch_tokens": 0}, ValueError, "max_batch_tokens=0 must be a positive integer"),
        ((["a"], ["x"]), {"batch_size": -2}, ValueError, "batch_size=-2 must be a positive integer"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            translator.score(*args, **kwargs)
    translator.model.max_sequence_length = 8
    with pytest.raises(ValueError, match=r"targets\[0\] has \d+ tokens \(the end token included\); the model scores "
                                         r"at most max_sequence_length=8"):
        translator.score(["a"], ["The old owner paints the big garden and the red car."])
