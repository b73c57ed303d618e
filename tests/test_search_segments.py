"""The segmented driver (search/segments.py): done rows leave, the cache grows, the hypotheses stay the same."""

import numpy as np
import pytest

from conftest import BACKEND, tiny_model, to_numpy
from keras_transformer.generation import generate_hypotheses
from keras_transformer.search import compiled, segments
from test_generation import sources

pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="the compiled drivers are TensorFlow's and JAX's")

# Sources of many lengths: with `EXTRA`, rows reach their maximum lengths
# (where the end id is forced) at different steps, so rows leave in turn.
LENGTHS = [2, 9, 3, 12, 5, 2, 7, 4, 10]
EXTRA = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def spied(monkeypatch):
    """Records each segment's rows and each cache growth; the cache starts at 2 positions."""
    monkeypatch.setattr(segments, "INITIAL_CACHE_LENGTH", 2)
    seen = {"rows": [], "grown": []}
    run_segments = segments.run_segments

    def spy(model, encoder_token_ids, max_lengths, alpha, beam_size, length, pieces, *args, **kwargs):
        start, advance = pieces

        def spied_advance(search_name, state, cache, *rest):
            seen["rows"].append(int(to_numpy(rest[0]).shape[0]))  # max_lengths [R]
            return advance(search_name, state, cache, *rest)

        grow = model.grow_cache

        def spied_grow(cache, length):
            seen["grown"].append(length)
            return grow(cache, length)

        model.grow_cache = spied_grow
        try:
            return run_segments(
                model, encoder_token_ids, max_lengths, alpha, beam_size, length, (start, spied_advance), *args, **kwargs
            )
        finally:
            del model.grow_cache

    monkeypatch.setattr(segments, "run_segments", spy)
    return seen


PREFIXES = [[11, 12, 13], None, [20], None, None, [5, 6], None, None, [7]]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_size=1, target_prefix=PREFIXES),
        dict(beam_size=4, num_hypotheses=3, target_prefix=PREFIXES),
        dict(beam_size=1, sampling_topk=10, num_hypotheses=2, seed=7),
    ],
    ids=["greedy", "beam", "sampling"],
)
def test_segments_give_the_whole_searchs_hypotheses(model, rng, spied, monkeypatch, kwargs):
    src = sources(rng, LENGTHS)
    monkeypatch.setattr(compiled, "SEGMENTS", False)
    whole = generate_hypotheses(model, src, max_extra_length=EXTRA, **kwargs)
    assert not spied["rows"]
    monkeypatch.setattr(compiled, "SEGMENTS", True)
    found = generate_hypotheses(model, src, max_extra_length=EXTRA, **kwargs)
    # The driver did what it is for: rows left in powers of two, the cache grew from 2.
    rows = spied["rows"]
    assert rows[0] == len(src) * (kwargs.get("num_hypotheses", 1) if "sampling_topk" in kwargs else 1)
    assert rows[-1] < rows[0] and all(r == rows[0] or r & (r - 1) == 0 for r in rows), rows
    assert spied["grown"][:2] == [4, 8], spied["grown"]
    np.testing.assert_array_equal(found.sequences, whole.sequences)
    # The attention's sums run over fewer positions: the last bits may differ.
    np.testing.assert_allclose(found.scores, whole.scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(found.log_probs, whole.log_probs, rtol=1e-5, atol=1e-5)


def test_grow_cache_keeps_the_written_positions_and_refuses_to_shrink(model, rng):
    src = sources(rng, [5, 3])
    cache = model.init_cache(model.encode(src), src, 4)
    written = {name: rng.normal(size=cache[name].shape).astype("float32") for name in ("self_key", "self_value")}
    cache = dict(cache, **written)
    grown = model.grow_cache(cache, 9)
    for name in ("self_key", "self_value"):
        before, after = to_numpy(cache[name]), to_numpy(grown[name])
        assert after.shape[3] == 9
        np.testing.assert_array_equal(after[:, :, :, :4], before)
        assert not after[:, :, :, 4:].any()
    with pytest.raises(ValueError, match="max_length=3 is shorter than the cache's 4 positions"):
        model.grow_cache(cache, 3)
