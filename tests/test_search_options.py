"""`SearchOptions`: the search options as one value, checked once when made, taken as `options=` everywhere.

Each bad value is refused in one line naming it; `options=` gives what the
keywords give on Keras and on ONNX Runtime; keywords and `options=` together
are refused; the HTTP server's 400 messages are SearchOptions' own.
"""

import dataclasses
import inspect

import numpy as np
import pytest

from conftest import tiny_model
from keras_transformer.search.options import DEFAULTS, SearchOptions, resolve
from keras_transformer.tokenizers.sentencepiece import train_tokenizer
from keras_transformer.translator import Translator
from test_translator import SENTENCES

TEXTS = ["Nobody sees it!", "The old owner paints the big garden.", "A student finds two cats.", "Our children."]

# option -> (bad value, the whole message)
BAD = {
    "beam_size": (0, r"beam_size=0 must be an integer >= 1 \(1 is greedy search\)"),
    "beam_size a bool": (True, r"beam_size=True must be an integer >= 1 \(1 is greedy search\)"),
    "length_penalty": (-0.5, r"length_penalty=-0.5 must be a finite number >= 0 \(the paper uses 0.6\)"),
    "length_penalty a string": ("0.6", r"length_penalty='0.6' must be a finite number >= 0 \(the paper uses 0.6\)"),
    "max_extra_length": (2.5, r"max_extra_length=2.5 must be an integer >= 0"),
    "patience": (0, r"patience=0 must be None \(stop when no live beam can win: the exact search\) or a finite "
                    r"number > 0 \(CTranslate2's patience: stop a row once round\(beam_size \* patience\) "
                    r"hypotheses ended\)"),
    "num_hypotheses": (0, r"num_hypotheses=0 must be an integer >= 1"),
    "sampling_topk": (-1, r"sampling_topk=-1 must be an integer >= 0 \(1: no sampling, 0: the whole vocabulary\)"),
    "sampling_topp": (1.5, r"sampling_topp=1.5 must be a number in \(0, 1\]"),
    "sampling_temperature": (float("inf"), r"sampling_temperature=inf must be a finite number > 0"),
    "seed": (-1, r"seed=-1 must be an integer in \[0, 2147483646\]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_value_is_refused_in_one_line_naming_it(case):
    value, message = BAD[case]
    with pytest.raises(ValueError, match=f"^{message}$") as raised:
        SearchOptions(**{case.split(" ")[0]: value})
    assert "\n" not in str(raised.value)


def test_options_that_do_not_go_together_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^sampling_topk=3 samples one token at a time and needs beam_size=1, "
                                         r"received beam_size=4$"):
        SearchOptions(sampling_topk=3)
    with pytest.raises(ValueError, match=r"^num_hypotheses=5 must be <= beam_size=4 \(the search keeps beam_size "
                                         r"hypotheses; sample with sampling_topk != 1 for more\)$"):
        SearchOptions(num_hypotheses=5)
    # More samples than beams is fine, and so are NumPy numbers.
    assert SearchOptions(beam_size=1, num_hypotheses=5, sampling_topk=0, seed=np.int64(3)).count == 5
    with pytest.raises(ValueError, match=r"^beam_size=0 must be"):  # replace checks again
        dataclasses.replace(SearchOptions(), beam_size=0)


def test_options_are_frozen_and_equal_options_are_one_batching_key():
    options = SearchOptions(beam_size=2, length_penalty=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.beam_size = 3
    assert options == SearchOptions(2, 1.0) and len({options, SearchOptions(2, 1.0), SearchOptions()}) == 2
    assert options.search_args() == dict(beam_size=2, length_penalty=1.0, max_extra_length=50)
    sampled = SearchOptions(beam_size=1, patience=1, sampling_topk=0, seed=4)
    assert sampled.search_args() == dict(
        beam_size=1, length_penalty=0.6, max_extra_length=50, patience=1, sampling_topk=0, sampling_topp=1.0,
        sampling_temperature=1.0, seed=4,
    )


def _signatures():
    from export.runtime import OnnxSeq2Seq
    from keras_transformer import generation
    from keras_transformer.model import TransformerModel

    return [Translator.translate, Translator.translate_hypotheses, Translator.translate_iterable,
            Translator.translate_file, generation.generate, generation.generate_hypotheses, OnnxSeq2Seq.generate,
            OnnxSeq2Seq.generate_hypotheses, TransformerModel.generate, TransformerModel.generate_hypotheses]


def test_every_entry_point_takes_options_or_search_keywords_and_lists_no_option():
    """The option list exists once (`SearchOptions`): each entry point takes `options=` and `**search_keywords`."""
    pytest.importorskip("keras")
    for method in _signatures():
        parameters = inspect.signature(method).parameters
        assert parameters["options"].default is None, method.__qualname__
        assert parameters["search_keywords"].kind == inspect.Parameter.VAR_KEYWORD, method.__qualname__
        assert not set(parameters) & set(DEFAULTS), method.__qualname__


def test_an_unknown_search_keyword_is_a_type_error_naming_it(translator):
    from keras_transformer.generation import generate

    with pytest.raises(TypeError, match=r"^translate\(\) got an unexpected keyword argument 'beam_sise'; its search "
                                        r"keywords \(SearchOptions fields\) are beam_size, length_penalty, "
                                        r"max_extra_length, patience, sampling_topk, sampling_topp, "
                                        r"sampling_temperature, seed$"):
        translator.translate(TEXTS, beam_sise=2)
    with pytest.raises(TypeError, match=r"^translate_iterable\(\) got an unexpected keyword argument 'num_hypotheses'"):
        translator.translate_iterable(TEXTS, num_hypotheses=2)
    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument 'seed'; .* are beam_size, "
                                        r"length_penalty, max_extra_length, patience$"):
        generate(translator.model, np.array([[5, 3]], np.int32), seed=1)
    with pytest.raises(TypeError, match=r"^generate_hypotheses\(\) got an unexpected keyword argument 'beams'"):
        translator.model.generate_hypotheses(np.array([[5, 3]], np.int32), beams=2)
    with pytest.raises(TypeError, match="positional argument"):  # the search options are keywords only
        translator.translate(TEXTS, 2)


def test_options_or_keywords_not_both():
    options = SearchOptions(beam_size=2)
    assert resolve(options, beam_size=4, length_penalty=0.6, num_hypotheses=1) is options  # defaults: not given
    assert resolve(None, beam_size=2) == options
    with pytest.raises(ValueError, match=r"^pass the search options as options= or as keywords, not both: received "
                                         r"options and beam_size=3, seed=1$"):
        resolve(options, beam_size=3, seed=1)
    with pytest.raises(TypeError, match=r"^options must be a SearchOptions or None, received dict$"):
        resolve({"beam_size": 2})


# ---------------------------------------------------------------------- #
# options= equals the keywords: Keras
# ---------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def translator():
    tokenizer = train_tokenizer(SENTENCES, vocabulary_size=120)
    return Translator(tiny_model(vocabulary_size=120, seed=3), tokenizer)


SEARCHES = {
    "beam": dict(beam_size=3, length_penalty=1.0, max_extra_length=6),
    "greedy": dict(beam_size=1, max_extra_length=4),
    "patience": dict(beam_size=3, patience=1, max_extra_length=6),
    "sampling": dict(beam_size=1, sampling_topk=0, sampling_topp=0.9, sampling_temperature=1.5, seed=7,
                     max_extra_length=6),
}


def check_options_equal_keywords(translator):
    for name, search in SEARCHES.items():
        options = SearchOptions(**search)
        assert translator.translate(TEXTS, options=options) == translator.translate(TEXTS, **search), name
        assert list(translator.translate_iterable(iter(TEXTS), options=options)) == translator.translate(
            TEXTS, **search
        ), name
    search = dict(SEARCHES["beam"], num_hypotheses=2)
    assert translator.translate_hypotheses(TEXTS, options=SearchOptions(**search)) == translator.translate_hypotheses(
        TEXTS, **search
    )
    assert translator.translate_hypotheses(TEXTS, options=SearchOptions(**SEARCHES["sampling"], num_hypotheses=3)) == (
        translator.translate_hypotheses(TEXTS, num_hypotheses=3, **SEARCHES["sampling"])
    )
    assert translator.translate(TEXTS, target_prefix=["Ein", None, None, None],
                                options=SearchOptions(**SEARCHES["beam"])) == translator.translate(
        TEXTS, target_prefix=["Ein", None, None, None], **SEARCHES["beam"]
    )


def check_refusals(translator):
    with pytest.raises(ValueError, match=r"^pass the search options as options= or as keywords, not both: "
                                         r"received options and beam_size=2$"):
        translator.translate(TEXTS, beam_size=2, options=SearchOptions(beam_size=3))
    with pytest.raises(ValueError, match=r"^translate gives one output per source, received "
                                         r"options.num_hypotheses=2; call translate_hypotheses for more$"):
        translator.translate(TEXTS, options=SearchOptions(num_hypotheses=2))
    with pytest.raises(ValueError, match=r"^pass the search options .* received options and num_hypotheses=2$"):
        translator.translate_hypotheses(TEXTS, num_hypotheses=2, options=SearchOptions(num_hypotheses=2))


def test_options_equal_keywords_on_keras(translator):
    check_options_equal_keywords(translator)
    check_refusals(translator)


def test_generate_takes_options(translator):
    from keras_transformer.generation import generate, generate_hypotheses

    model, src = translator.model, np.array([[5, 6, 7, 3], [8, 9, 3, 0]], np.int32)
    np.testing.assert_array_equal(
        generate(model, src, options=SearchOptions(beam_size=2, max_extra_length=5)),
        model.generate(src, beam_size=2, max_extra_length=5),
    )
    found = model.generate_hypotheses(src, options=SearchOptions(beam_size=3, num_hypotheses=2, max_extra_length=5))
    expected = generate_hypotheses(model, src, beam_size=3, num_hypotheses=2, max_extra_length=5)
    for got, want in zip(found, expected):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------- #
# options= equals the keywords: ONNX Runtime
# ---------------------------------------------------------------------- #
def test_options_equal_keywords_on_onnx_runtime(tiny_onnx_export):
    from export.runtime import OnnxTranslator

    translator = OnnxTranslator(tiny_onnx_export, providers=["CPUExecutionProvider"])
    check_options_equal_keywords(translator)
    check_refusals(translator)
    model, src = translator.model, np.array([[5, 6, 7, 3], [8, 9, 3, 0]], np.int32)
    np.testing.assert_array_equal(model.generate(src, options=SearchOptions(beam_size=2, max_extra_length=5)),
                                  model.generate(src, beam_size=2, max_extra_length=5))


# ---------------------------------------------------------------------- #
# The HTTP server: a request's options are made once; a bad one is a 400 in SearchOptions' words
# ---------------------------------------------------------------------- #
def test_the_server_makes_the_options_once_and_answers_a_bad_value_with_its_line():
    from export.serve import ServerSettings
    from export.serve.app import RequestError, parse_request

    settings = ServerSettings(max_extra_length=5)
    _, options, _ = parse_request(b'{"text": ["a"], "beam_size": 2, "num_hypotheses": 2}', settings)
    assert options == SearchOptions(2, 0.6, 5, num_hypotheses=2)
    # Sampling fields without sampling change nothing: the request batches with the plain ones...
    _, options, _ = parse_request(b'{"text": ["a"], "sampling_topp": 0.5, "seed": 3}', settings)
    assert options == SearchOptions(4, 0.6, 5)
    # ... but a bad one is still refused, in SearchOptions' own line.
    for body, message in [
        (b'{"text": ["a"], "sampling_topp": 5}', "sampling_topp=5 must be a number in (0, 1]"),
        (b'{"text": ["a"], "sampling_topk": 0, "sampling_temperature": 0}',
         "sampling_temperature=0 must be a finite number > 0"),
        (b'{"text": ["a"], "num_hypotheses": "2"}', "num_hypotheses='2' must be an integer >= 1"),
        (b'{"text": ["a"], "beam_size": 2, "num_hypotheses": 3}',
         "num_hypotheses=3 must be <= beam_size=2 (the search keeps beam_size hypotheses; sample with sampling_topk "
         "!= 1 for more)"),
    ]:
        with pytest.raises(RequestError) as raised:
            parse_request(body, settings)
        assert (raised.value.status, raised.value.message, raised.value.reason) == (400, message, "bad_request")
