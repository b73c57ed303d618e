"""n-best hypotheses, target prefixes and sampling (generate_hypotheses, Translator) on every backend.

The n best are distinct, sorted, and the first is `generate`'s; every score
is a log-probability that teacher-forced scoring (`score_targets`, NumPy
over the model's logits) gives back; prefixes are followed and rows without
one are searched as before; sampling with top-k 1 is greedy search, a seed
reproduces, and the draw's hash equals a NumPy reference.
"""

import keras
import numpy as np
import pytest

from conftest import tiny_model, to_numpy
from keras_transformer.decoding import NO_PATIENCE, sample_keys
from keras_transformer.generation import Hypotheses, generate, generate_hypotheses, length_penalty_factor
from keras_transformer.search import sample
from keras_transformer.search.log_probs import FORCED_END_LOG_PROB, token_log_probs, token_log_probs_numpy
from keras_transformer.search.scoring import score_targets
from keras_transformer.tokenizers.sentencepiece import train_tokenizer
from keras_transformer.translator import Hypothesis, Translator
from test_scoring import sources
from test_translator import SENTENCES

PAD, START, END = 0, 2, 3
TEXTS = ["Nobody sees it!", "The old owner paints the big garden.", "A student finds two cats.", "Our children."]
SAMPLING = dict(beam_size=1, sampling_topk=0, sampling_temperature=1.5)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def src():
    return sources(np.random.default_rng(4), [5, 9, 3])


@pytest.fixture(scope="module")
def translator():
    tokenizer = train_tokenizer(SENTENCES, vocabulary_size=120)
    return Translator(tiny_model(vocabulary_size=120, seed=3), tokenizer)


def tokens_of(row):
    """The ids after the start id up to the end id (included)."""
    return row[1: int(np.flatnonzero(row[1:] == END)[0]) + 2]


def check_log_probs(model, src, found):
    """Each hypothesis' log-probability is its teacher-forced one; its score that over lp(|Y|)."""
    batch, count, _ = found.sequences.shape
    flat = found.sequences.reshape((batch * count, -1))
    log_probs, _ = score_targets(model, np.repeat(src, count, axis=0), flat)
    np.testing.assert_allclose(found.log_probs.reshape(-1), log_probs, atol=1e-4, rtol=1e-5)
    return flat


# ---------------------------------------------------------------------- #
# n-best
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_n_best_are_distinct_sorted_and_the_first_is_generates(model, src, compile):
    expected, expected_scores = generate(model, src, beam_size=4, return_scores=True, compile=compile)
    found = generate_hypotheses(model, src, beam_size=4, num_hypotheses=3, compile=compile)
    assert isinstance(found, Hypotheses)
    assert found.sequences.shape[:2] == found.scores.shape == found.log_probs.shape == (3, 3)
    assert found.sequences.dtype == np.int32 and found.scores.dtype == found.log_probs.dtype == np.float32
    np.testing.assert_array_equal(found.sequences[:, 0, : expected.shape[1]], expected)
    np.testing.assert_allclose(found.scores[:, 0], expected_scores, atol=1e-5)
    assert np.isfinite(found.scores).all()
    assert (np.diff(found.scores, axis=1) <= 0).all()
    for row in found.sequences:
        assert len({tuple(tokens_of(hypothesis)) for hypothesis in row}) == 3
    flat = check_log_probs(model, src, found)
    lengths = np.array([len(tokens_of(row)) for row in flat])
    np.testing.assert_allclose(
        found.scores.reshape(-1), found.log_probs.reshape(-1) / to_numpy(length_penalty_factor(lengths, 0.6)),
        rtol=1e-5,
    )


def test_one_hypothesis_of_greedy_search_is_greedy_search(model, src):
    expected, scores = generate(model, src, beam_size=1, return_scores=True)
    found = generate_hypotheses(model, src, beam_size=1)
    np.testing.assert_array_equal(found.sequences[:, 0, : expected.shape[1]], expected)
    np.testing.assert_allclose(found.scores[:, 0], scores, atol=1e-5)
    check_log_probs(model, src, found)


# ---------------------------------------------------------------------- #
# Target prefixes
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("beam_size", [1, 4])
def test_prefixes_are_followed_and_rows_without_one_are_searched_as_before(model, src, beam_size):
    prefixes = [[7, 8, 9], None, [11]]
    found = generate_hypotheses(model, src, beam_size=beam_size, num_hypotheses=min(beam_size, 2),
                                target_prefix=prefixes, max_extra_length=4)
    for row, prefix in enumerate(prefixes):
        for hypothesis in found.sequences[row]:
            if prefix:
                np.testing.assert_array_equal(hypothesis[1: 1 + len(prefix)], prefix)
    alone = generate_hypotheses(model, src[1:2], beam_size=beam_size, num_hypotheses=min(beam_size, 2),
                                max_extra_length=4)
    np.testing.assert_array_equal(found.sequences[1, :, : alone.sequences.shape[2]], alone.sequences[0])
    np.testing.assert_allclose(found.scores[1], alone.scores[0], atol=1e-5)
    # The forced tokens keep the model's log-probabilities: a score is the whole output's.
    check_log_probs(model, src, found)


def test_after_the_prefix_greedy_search_takes_the_teacher_forced_argmax(model, src):
    prefix = [7, 8, 9]
    found = generate_hypotheses(model, src[:1], beam_size=1, target_prefix=[prefix])
    row = tokens_of(found.sequences[0, 0])
    full = np.concatenate([[START], row])[None, :-1]
    logits = to_numpy(model({"encoder_token_ids": src[:1], "decoder_token_ids": full}))[0]
    log_probs = token_log_probs_numpy(model, logits, np.arange(1, len(row) + 1)[:, None], np.array([99]))
    assert list(row[:3]) == prefix
    np.testing.assert_array_equal(row[3:-1], np.argmax(log_probs[3:-1], axis=-1))


def test_a_prefix_longer_than_the_row_limit_extends_it_to_the_end_id(model, src):
    prefix = list(range(4, 14))  # 10 tokens > source length + max_extra_length
    found = generate_hypotheses(model, src[2:3], beam_size=2, max_extra_length=0, target_prefix=[prefix])
    assert list(tokens_of(found.sequences[0, 0])) == prefix + [END]


def assert_twin_rules_agree(model, logits, generated_lengths, max_lengths, prefix):
    """The keras.ops token rule excludes what the NumPy twin does and gives its values."""
    for generated_length in generated_lengths:
        expected = token_log_probs_numpy(model, logits, generated_length, max_lengths, prefix)
        actual = to_numpy(token_log_probs(model, keras.ops.convert_to_tensor(logits), generated_length,
                                          keras.ops.convert_to_tensor(max_lengths), keras.ops.convert_to_tensor(prefix)))
        np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 50), (2, 3, 50)])
def test_the_twin_token_rules_agree_with_a_prefix(model, shape):
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 4.0, shape).astype("float32")
    max_lengths = np.array([5, 3, 9, 6][: shape[0]], "int32")
    prefix = np.array([[7, 8, 0], [9, 0, 0], [0, 0, 0], [5, 6, 7]][: shape[0]], "int32")
    assert_twin_rules_agree(model, logits, (1, 2, 3, 4), max_lengths, prefix)
    rule = token_log_probs_numpy(model, logits, 2, max_lengths, prefix)
    plain = token_log_probs_numpy(model, logits, 2, max_lengths)
    # Row 0 at its second token: only 8, with its own log-probability; row 1's prefix has ended.
    assert np.isneginf(np.delete(rule[0], 8, axis=-1)).all()
    np.testing.assert_array_equal(rule[0, ..., 8], plain[0, ..., 8])
    np.testing.assert_array_equal(rule[1], plain[1])


def test_the_twin_token_rules_agree_where_a_prefix_meets_the_row_limit(model):
    """Rows held twice (at their maximum length inside their prefix, which callers refuse) or to an id the
    search never generates (start in a prefix): the keras.ops rule excludes and floors what the NumPy twin
    does."""
    logits = np.random.default_rng(2).normal(0.0, 4.0, (4, 50)).astype("float32")
    logits[1, END] = -1e30  # the forced end id with probability 0: floored
    max_lengths = np.array([2, 2, 2, 9], "int32")
    prefix = np.array([[7, 8], [7, END], [START, 0], [5, START]], "int32")
    assert_twin_rules_agree(model, logits, (1, 2), max_lengths, prefix)
    rule = token_log_probs_numpy(model, logits, 2, max_lengths, prefix)
    assert np.isneginf(rule[0]).all() and np.isneginf(rule[3]).all()  # 8 is not the end id; start never
    assert rule[1, END] == np.float32(FORCED_END_LOG_PROB) and np.isneginf(np.delete(rule[1], END)).all()
    assert np.isfinite(rule[2, END]) and np.isneginf(np.delete(rule[2], END)).all()  # the prefix has ended


# ---------------------------------------------------------------------- #
# Sampling
# ---------------------------------------------------------------------- #
def _np_minstd(x):
    return (48271 * x) % sample.MODULUS


def _np_mix(x):
    x = _np_minstd(x)
    low = x % 46337
    return _np_minstd((x + low * low + 1013904223) % sample.MODULUS)


def test_the_draws_hash_equals_a_numpy_reference():
    """Integer ops only: every backend (and ONNX Runtime, tests/test_export_onnx.py) gives these integers."""
    seed, step = 123456, 17
    keys = np.array([0, 1, 2**31 - 2], np.int64)
    tokens = np.array([[0, 1, 2, 59], [5, 6, 7, 8], [2**20, 3, 0, 1]], np.int64)
    row = _np_mix((_np_mix((_np_mix(seed) + step) % sample.MODULUS) + keys) % sample.MODULUS)
    expected = _np_mix(_np_mix((row[:, None] + tokens) % sample.MODULUS))
    actual = to_numpy(sample.random_integers(seed, step, keras.ops.convert_to_tensor(keys.astype("int32")),
                                             keras.ops.convert_to_tensor(tokens.astype("int32"))))
    np.testing.assert_array_equal(actual, expected)
    assert actual.dtype == np.int32


def test_draws_follow_the_distribution_and_the_cuts():
    probs = np.array([0.0, 0.0, 0.4, 0.3, 0.2, 0.1], "float32")  # ids 0, 1 excluded (-inf)
    draws = 4000
    log_probs = np.tile(np.log(np.where(probs > 0, probs, 1.0)), (draws, 1)).astype("float32")
    log_probs[:, :2] = -np.inf
    keys = keras.ops.convert_to_tensor(np.arange(draws, dtype="int32") * 7919)

    def frequencies(topk, topp, temperature=1.0):
        tokens, chosen = sample.draw(keras.ops.convert_to_tensor(log_probs), 5, 3, keys, topk, topp, temperature)
        tokens, chosen = to_numpy(tokens), to_numpy(chosen)
        np.testing.assert_allclose(chosen, log_probs[np.arange(draws), tokens], rtol=1e-6)
        return np.bincount(tokens, minlength=6) / draws

    np.testing.assert_allclose(frequencies(0, 1.0), probs, atol=0.03)
    np.testing.assert_allclose(frequencies(2, 1.0), [0, 0, 4 / 7, 3 / 7, 0, 0], atol=0.03)
    np.testing.assert_allclose(frequencies(0, 0.75), [0, 0, 4 / 9, 3 / 9, 2 / 9, 0], atol=0.03)
    np.testing.assert_array_equal(frequencies(1, 1.0), [0, 0, 1, 0, 0, 0])
    tempered = probs[2:] ** 2 / (probs[2:] ** 2).sum()
    np.testing.assert_allclose(frequencies(0, 1.0, 0.5)[2:], tempered, atol=0.03)


def test_sampling_cut_to_one_token_is_greedy_search(model, src):
    """`sampling_topk=1` is greedy search itself; the sampling search cut to its most probable token is too."""
    prefixes = [None, [7], None]
    greedy = generate_hypotheses(model, src, beam_size=1, target_prefix=prefixes)
    expected = generate(model, src, beam_size=1)
    np.testing.assert_array_equal(greedy.sequences[[0, 2], 0, : expected.shape[1]], expected[[0, 2]])
    cut = generate_hypotheses(model, src, beam_size=1, num_hypotheses=2, sampling_topk=0, sampling_topp=1e-6,
                              target_prefix=prefixes, seed=9)
    for k in range(2):
        np.testing.assert_array_equal(cut.sequences[:, k], greedy.sequences[:, 0])
        # Sums of the tokens' float32 log probabilities from two compiled searches (a row that runs to the length
        # limit sums to about -119, where float32's spacing is 7.6e-6): to float32's rounding, not to 1e-5 absolute.
        np.testing.assert_allclose(cut.log_probs[:, k], greedy.log_probs[:, 0], rtol=1e-6, atol=1e-5)


def test_a_seed_reproduces_in_any_batch_and_another_seed_differs(model, src):
    found = generate_hypotheses(model, src, num_hypotheses=4, seed=11, **SAMPLING)
    again = generate_hypotheses(model, src, num_hypotheses=4, seed=11, **SAMPLING)
    np.testing.assert_array_equal(found.sequences, again.sequences)
    alone = generate_hypotheses(model, src[2:3, :3], num_hypotheses=4, seed=11, **SAMPLING)
    np.testing.assert_array_equal(found.sequences[2, :, : alone.sequences.shape[2]], alone.sequences[0])
    other = generate_hypotheses(model, src, num_hypotheses=4, seed=12, **SAMPLING)
    assert not np.array_equal(found.sequences, other.sequences)
    assert (np.diff(found.scores, axis=1) <= 0).all()
    check_log_probs(model, src, found)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_samples_with_a_prefix_are_the_same_compiled_or_eager(model, src, compile):
    found = generate_hypotheses(model, src, num_hypotheses=2, seed=3, target_prefix=[[9, 9], None, None],
                                compile=compile, **SAMPLING)
    reference = generate_hypotheses(model, src, num_hypotheses=2, seed=3, target_prefix=[[9, 9], None, None],
                                    compile=False, **SAMPLING)
    np.testing.assert_array_equal(found.sequences, reference.sequences)
    assert (found.sequences[0, :, 1:3] == 9).all()


def test_sample_keys_ignore_padding_and_differ_per_sample():
    keys = sample_keys(np.array([[5, 6, 3, 0], [5, 6, 3, 0], [7, 3, 0, 0], [7, 3, 0, 0]]), 2)
    assert keys[0] != keys[1] and keys[0] != keys[2]
    np.testing.assert_array_equal(sample_keys(np.array([[5, 6, 3], [5, 6, 3]]), 2), keys[:2])


# ---------------------------------------------------------------------- #
# Bad input: one line naming the argument
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beam_size=2, num_hypotheses=3), r"num_hypotheses=3 must be <= beam_size=2"),
        (dict(beam_size=1, num_hypotheses=0), r"num_hypotheses=0 must be an integer >= 1"),
        (dict(beam_size=1, sampling_topk=-1), r"sampling_topk=-1 must be an integer >= 0"),
        (dict(beam_size=1, sampling_topk=5, sampling_temperature=0), r"sampling_temperature=0 must be .* > 0"),
        (dict(beam_size=1, sampling_topk=5, sampling_topp=0.0), r"sampling_topp=0.0 must be a number in \(0, 1\]"),
        (dict(beam_size=4, sampling_topk=5), r"sampling_topk=5 .* needs beam_size=1, received beam_size=4"),
        (dict(beam_size=1, seed=-1), r"seed=-1 must be an integer in \[0, 2147483646\]"),
        (dict(target_prefix=[[5]]), r"target_prefix has 1 rows; expected one per source row \(3\)"),
        (dict(target_prefix=[[5, END], None, None]), r"target_prefix\[0\] holds id 3; a prefix holds tokens only"),
        (dict(target_prefix=[None, [5] * 63, None]),
         r"target_prefix\[1\] has 63 tokens; at most 62 are allowed \(max_sequence_length=64"),
        (dict(target_prefix=[None, None, [5, 0, 6]]), r"target_prefix\[2\] has a pad id \(0\) before its last token"),
    ],
)
def test_bad_arguments_are_one_line_naming_them(model, src, kwargs, match):
    with pytest.raises(ValueError, match=match) as raised:
        generate_hypotheses(model, src, **kwargs)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------- #
# Translator
# ---------------------------------------------------------------------- #
def test_translate_hypotheses_are_distinct_sorted_and_the_first_is_translate(translator):
    best = translator.translate(TEXTS, beam_size=4)
    found = translator.translate_hypotheses(TEXTS, beam_size=4, num_hypotheses=3, batch_size=3)
    assert [hypotheses[0].text for hypotheses in found] == best
    for hypotheses in found:
        assert len(hypotheses) == 3 and all(isinstance(h, Hypothesis) for h in hypotheses)
        assert len({tuple(h.token_ids) for h in hypotheses}) == 3
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
        assert all(h.token_ids[-1] == END for h in hypotheses)
    # The search's log-probability is teacher-forced scoring's, on the same ids.
    source = translator.encode(TEXTS[:1]) * 3
    rows = [[START] + h.token_ids for h in found[0]]
    width = max(map(len, rows))
    targets = np.array([row + [0] * (width - len(row)) for row in rows], "int32")
    log_probs, _ = score_targets(translator.model, np.array(source, "int32"), targets)
    np.testing.assert_allclose([h.log_prob for h in found[0]], log_probs, atol=1e-4)


def test_translate_with_target_prefixes_starts_with_them(translator):
    prefixes = ["The teacher", None, "", "Nobody likes"]
    found = translator.translate_hypotheses(TEXTS, beam_size=3, num_hypotheses=2, target_prefix=prefixes)
    plain = translator.translate(TEXTS, beam_size=3)
    texts = translator.translate(TEXTS, beam_size=3, target_prefix=prefixes)
    for i, prefix in enumerate(prefixes):
        assert texts[i] == found[i][0].text
        if prefix:
            ids = translator.tokenizer.encode([prefix], add_end=False, target=True)[0]
            assert all(h.token_ids[: len(ids)] == ids for h in found[i])
            assert texts[i].startswith(prefix)
        else:
            assert texts[i] == plain[i]


def test_translate_samples_reproducibly_in_any_batches(translator, tmp_path):
    sampled = translator.translate(TEXTS, beam_size=1, sampling_topk=0, seed=5, batch_size=4)
    assert translator.translate(TEXTS, beam_size=1, sampling_topk=0, seed=5, batch_size=1) == sampled
    assert translator.translate(TEXTS, beam_size=1, sampling_topk=1, seed=5) == translator.translate(TEXTS, beam_size=1)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    translator.translate_file(source, tmp_path / "out.txt", beam_size=1, sampling_topk=0, seed=5, max_batch_tokens=16)
    assert (tmp_path / "out.txt").read_text().splitlines() == sampled
    samples = translator.translate_hypotheses(TEXTS[:2], beam_size=1, num_hypotheses=3, sampling_topk=0, seed=5)
    assert [len(row) for row in samples] == [3, 3]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda t: t.translate_hypotheses(["A cat.", " "]), r"texts\[1\] is empty; translate_hypotheses needs"),
        (lambda t: t.translate_hypotheses(["A cat."], beam_size=2, num_hypotheses=3), r"num_hypotheses=3 must be <="),
        (lambda t: t.translate(["A cat."], target_prefix=["Nobody " * 70]), r"target_prefix\[0\] has \d+ tokens"),
        (lambda t: t.translate(["A cat.", "B"], target_prefix=["x"]), r"target_prefix has 1 entries"),
        (lambda t: t.translate(["", "B"], target_prefix=["x", None]), r"texts\[0\] is empty but target_prefix\[0\]"),
        (lambda t: t.translate(["A cat."], beam_size=1, sampling_topk=-2), r"sampling_topk=-2 must be"),
        (lambda t: t.translate(["A cat."], beam_size=1, sampling_topk=3, sampling_temperature=0.0),
         r"sampling_temperature=0.0 must be"),
    ],
)
def test_translator_refuses_bad_input_in_one_line(translator, call, match):
    with pytest.raises(ValueError, match=match) as raised:
        call(translator)
    assert "\n" not in str(raised.value)


def test_translate_cli_samples_and_refuses_a_bad_option_in_one_line(translator, tmp_path, monkeypatch, capsys):
    import io

    from keras_transformer.translate import main as translate_main

    preset = tmp_path / "preset"
    translator.model.save_to_preset(preset, tokenizer=translator.tokenizer)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    translate_main(["--preset", str(preset), "--beam-size", "1", "--sampling-topk", "0", "--seed", "5",
                    "--no-progress"])
    assert capsys.readouterr().out.splitlines() == translator.translate(TEXTS, beam_size=1, sampling_topk=0, seed=5)
    with pytest.raises(SystemExit):
        translate_main(["--preset", str(preset), "--beam-size", "1", "--sampling-temperature", "0",
                        "--sampling-topk", "3", "--src", str(preset / "config.json"), "--output",
                        str(tmp_path / "out.txt")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sampling_temperature=0.0 must be a finite number > 0" in err
    assert not (tmp_path / "out.txt").exists()


# ---------------------------------------------------------------------- #
# rows_done: a row that is done can leave the batch (export/steps.py)
# ---------------------------------------------------------------------- #
@pytest.mark.parametrize("search_name, beam_size, num_hypotheses", [("greedy", 1, 1), ("beam", 4, 1), ("beam", 3, 2)])
def test_a_row_that_is_done_keeps_its_hypotheses_until_the_search_ends(model, search_name, beam_size, num_hypotheses):
    """Once `rows_done` says so, a row stays done and its first `num_hypotheses` hypotheses never change, while
    the batch's other rows go on (what lets a driver take the row out of the batch)."""
    from keras import ops

    from keras_transformer.search import loop
    from keras_transformer.search.lengths import search_lengths

    ids = sources(np.random.default_rng(11), [2, 12, 4, 7, 3])
    max_lengths, length, _ = search_lengths(ids, 6, model.max_sequence_length)
    length = int(to_numpy(length))
    options = {"num_hypotheses": ops.convert_to_tensor(num_hypotheses, "int32")} if search_name == "beam" else None
    search, state, cache = loop.start(model, ids, beam_size, length, 0, search_name, options)
    alpha = ops.convert_to_tensor(0.6, "float32")
    first_done = {}  # row -> its hypotheses when it was first done
    steps = 0
    while bool(to_numpy(search.keep_going(state, max_lengths, alpha, length))):
        state, cache = loop.step(model, search, state, cache, max_lengths, alpha)
        steps += 1
        done = to_numpy(search.rows_done(state, max_lengths, alpha))
        hypotheses = [to_numpy(x)[:, :num_hypotheses] for x in search.hypotheses(state)]
        for row in range(len(ids)):
            if row in first_done:
                assert done[row], (row, steps)
                for before, now in zip(first_done[row], hypotheses):
                    np.testing.assert_array_equal(now[row], before)
            elif done[row]:
                first_done[row] = [x[row].copy() for x in hypotheses]
    # Rows were done at different steps, before the search ended.
    assert len(first_done) == len(ids) or steps == length - 1
    assert len(first_done) >= 2


def test_beam_rows_done_on_ties_and_rows_without_any_beam():
    """A row is done when its n-th finished score reaches the best live bound (ties included) or when it has
    neither finished nor live beams (-inf >= -inf)."""
    from keras import ops

    from keras_transformer.search import beam

    lp = np.float32(to_numpy(length_penalty_factor(5, 0.6)))
    neg_inf = float("-inf")
    state = {
        "live_log_probs": np.array([[-2.0, -3.0], [-2.0, -3.0], [neg_inf, neg_inf], [-1.0, -4.0]], np.float32),
        "finished_scores": np.array(
            [[np.float32(-2.0) / lp, -9.0], [-1.0, np.float32(-2.1) / lp], [neg_inf, neg_inf], [-0.5, neg_inf]],
            np.float32,
        ),
        "num_hypotheses": np.int32(2),
        "ended": np.array([2, 1, 0, 5], np.int32),
        "ended_to_stop": np.int32(NO_PATIENCE),
    }
    state = {name: ops.convert_to_tensor(value) for name, value in state.items()}
    max_lengths = ops.convert_to_tensor(np.full((4,), 5, np.int32))
    done = to_numpy(beam.rows_done(state, max_lengths, ops.convert_to_tensor(0.6)))
    # Row 0: 2nd best -9 < bound -2/lp; row 1: -2.1/lp < -2/lp; row 2: no beams; row 3: no 2nd finished.
    np.testing.assert_array_equal(done, [False, False, True, False])
    state["num_hypotheses"] = ops.convert_to_tensor(np.int32(1))
    done = to_numpy(beam.rows_done(state, max_lengths, ops.convert_to_tensor(0.6)))
    # Row 0: the best finished ties the bound; row 3: -0.5 >= -1/lp.
    np.testing.assert_array_equal(done, [True, True, True, True])
    # With a patience (2 ended extensions): row 0 has 2 ended and a 2nd finished hypothesis; row 1 has 1
    # ended; row 3 has 5 ended but no 2nd finished hypothesis.
    state.update(num_hypotheses=ops.convert_to_tensor(np.int32(2)), ended_to_stop=ops.convert_to_tensor(np.int32(2)))
    done = to_numpy(beam.rows_done(state, max_lengths, ops.convert_to_tensor(0.6)))
    np.testing.assert_array_equal(done, [True, False, True, False])
