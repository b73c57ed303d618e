"""Word alignments (`keras_transformer.documents.alignment`, `translate_hypotheses(return_alignment=True)`).

The rule against hand-made attention and pieces; the fused step's attention
output against the Keras model's; Keras against ONNX Runtime through the
translators; a model trained to copy aligns each token to itself. The
CTranslate2 comparison is in tests/test_export_ctranslate2.py (its export
and fixtures).
"""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from conftest import BACKEND, TINY_CORPUS, tiny_export_model
from keras_transformer import data, training
from keras_transformer.documents.alignment import WordAlignment, hard_alignment, word_alignment, word_spans


def test_word_spans_follow_the_word_start_mark():
    pieces = ["▁The", "▁c", "ats", "▁", "sat", "."]
    spans, word_of_piece = word_spans(pieces, "The cats  sat.")
    assert spans == [(0, 3), (4, 8), (10, 14)]  # a lone "▁" starts the word at its next piece
    assert word_of_piece == [0, 1, 1, 2, 2, 2]
    # A piece that is not in the text (a special piece) spans nothing, where it was looked for.
    assert word_spans(["▁a", "▁<unk>", "▁b"], "a b") == ([(0, 1), (2, 2), (2, 3)], [0, 1, 2])
    # subword-nmt's BPE (FSMT): "</w>" ends a word.
    assert word_spans(["The</w>", "c", "ats</w>", "sat</w>"], "The cats sat") == ([(0, 3), (4, 8), (9, 12)],
                                                                                [0, 1, 1, 2])


def test_word_alignment_gives_each_target_word_its_source_words_in_source_order():
    source, target = "the black cat", "le chat noir"
    alignment = [0, 2, 2, 1]  # ▁le ▁ch at ▁noir -> ▁the ▁cat ▁cat ▁black
    words = word_alignment(alignment, ["▁the", "▁black", "▁cat"], source, ["▁le", "▁ch", "at", "▁noir"], target)
    assert words == [WordAlignment((0, 2), ((0, 3),)), WordAlignment((3, 7), ((10, 13),)),
                     WordAlignment((8, 12), ((4, 9),))]
    assert [(target[slice(*w.target)], [source[slice(*s)] for s in w.source]) for w in words] == [
        ("le", ["the"]), ("chat", ["cat"]), ("noir", ["black"])]
    # A word whose pieces align to two source words gets both, in source order.
    words = word_alignment([2, 0], ["▁a", "▁b", "▁c"], "a b c", ["▁x", "y"], "xy")
    assert words == [WordAlignment((0, 2), ((0, 1), (4, 5)))]


def test_hard_alignment_leaves_out_the_source_end_token():
    attention = np.array([[0.1, 0.3, 0.6], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])  # 2 tokens + end; the end is largest
    assert hard_alignment(attention, source_length=3, target_length=2) == [1, 0]
    assert hard_alignment(attention, source_length=1, target_length=1) == [0]  # only the end id: itself


def test_fused_step_attention_output_equals_keras():
    """`with_alignment_output`'s graph gives the Keras model's head-averaged last-layer cross-attention."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from export.fused_step import ALIGNMENT_OUTPUT, build_fused_step, fused_step_weights, with_alignment_output
    from export.steps import FusedDecoder

    model = tiny_export_model()
    source = np.array([[5, 6, 7, 8, 3, 0, 0], [9, 10, 3, 0, 0, 0, 0]], np.int32)  # padding: masked out
    target = np.array([[2, 11, 12, 13, 3], [2, 14, 3, 0, 0]], np.int32)
    expected = model.alignment_attention(source, target)  # [B, T, S]
    step = build_fused_step(fused_step_weights(model))
    assert ALIGNMENT_OUTPUT not in [output.name for output in step.graph.output]  # the default step: no extra work
    session = ort.InferenceSession(with_alignment_output(step).SerializeToString())
    cache = {name: keras.ops.convert_to_numpy(value) for name, value in model.init_cache(
        model.encode(source), source, 1).items() if not name.startswith("self_")}
    decoder = FusedDecoder(session, dict(cache, buffer_length=target.shape[1]), 1, initial_length=target.shape[1])
    found = np.zeros_like(expected)
    for index in range(target.shape[1]):
        decoder.step(np.ascontiguousarray(target[:, index]), index)
        found[:, index] = decoder.attention
    np.testing.assert_allclose(found[0], expected[0], atol=1e-6)
    np.testing.assert_allclose(found[1, :3], expected[1, :3], atol=1e-6)  # (after its end id: pad queries)
    assert np.all(found[:, :, 5:] == 0) and np.all(found[1, :, 3:] == 0)  # no weight on padding


@pytest.fixture(scope="module")
def keras_translator(tiny_preset_dir):
    return kt.Translator.from_preset(tiny_preset_dir)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the export holds the weights of the TensorFlow run's "
                    "tiny_preset_dir (the random initialisers differ by backend), as in test_export_onnx.py")
def test_onnx_runtime_alignments_equal_keras(tiny_onnx_export, keras_translator):
    """OnnxTranslator and the Keras Translator: the same hypotheses, attention and alignments, beam 4, 2-best."""
    from export.runtime import OnnxTranslator

    onnx_translator = OnnxTranslator(tiny_onnx_export)
    texts = TINY_CORPUS[:4]
    keywords = dict(beam_size=4, num_hypotheses=2, max_extra_length=6, return_alignment=True)
    told = {}  # finished=: with alignments, each text's hypotheses are told aligned, with its batch
    ours, theirs = (t.translate_hypotheses(texts, **keywords) for t in (keras_translator, onnx_translator))
    assert onnx_translator.translate_hypotheses(texts, finished=told.__setitem__, **keywords) == theirs
    assert told == dict(enumerate(theirs))
    compared = 0
    for text, keras_hypotheses, onnx_hypotheses in zip(texts, ours, theirs):
        for a, b in zip(keras_hypotheses, onnx_hypotheses):
            if a.token_ids != b.token_ids:
                continue
            assert len(a.alignment) == len(a.token_ids) - 1  # the end id has none
            assert (a.alignment, a.word_alignment) == (b.alignment, b.word_alignment)
            for word in a.word_alignment:  # spans of words: no spaces inside, inside the texts
                assert a.text[slice(*word.target)].strip() == a.text[slice(*word.target)] != ""
                assert all(text[slice(*span)] and " " not in text[slice(*span)] for span in word.source)
            compared += 1
    assert compared >= 4
    source = np.array(keras_translator.encode(texts[:1]), np.int32)
    target = np.array([[keras_translator.model.start_id, *ours[0][0].token_ids]], np.int32)
    np.testing.assert_allclose(onnx_translator.model.alignment_attention(source, target),
                               keras_translator.model.alignment_attention(source, target), atol=1e-5)


def test_bad_return_alignment_is_refused_in_one_line(tiny_onnx_export, keras_translator):
    from export.runtime import OnnxSeq2Seq

    with pytest.raises(ValueError, match=r"^return_alignment='yes' must be True or False$"):
        keras_translator.translate_hypotheses(["Hello."], return_alignment="yes")

    class NoAttention:  # a decoding-protocol model that gives no attention weights
        vocabulary_size, pad_id, start_id, end_id = keras_translator.model.vocabulary_size, 0, 2, 3

    translator = kt.Translator.__new__(kt.Translator)
    translator.model, translator.tokenizer = NoAttention(), keras_translator.tokenizer
    with pytest.raises(ValueError, match=r"return_alignment=True needs .* NoAttention does not give; .* leave "
                                         "return_alignment out"):
        translator.translate_hypotheses(["Hello."], return_alignment=True)
    model = OnnxSeq2Seq(tiny_onnx_export)
    model.config = dict(model.config, graphs={k: v for k, v in model.config["graphs"].items()
                                              if k != "fused_decoder_step"})
    with pytest.raises(ValueError, match=r"^return_alignment: .* has no fused decoder step .*Translator.from_preset"):
        model.check_alignment()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="training dynamics differ by backend; the rule does not")
def test_a_model_trained_to_copy_aligns_each_token_to_itself():
    """One layer trained for 300 steps to copy its source: the alignment is the diagonal.

    At least 95% of the tokens align to themselves (untrained, about one in six
    would). Not every one: whether the last few rows' argmax lands one place
    off depends on the CPU's kernels (an AMX CPU's oneDNN gave 114 of 115 after
    150 steps, where another CPU gave all); after 300 steps three seeds gave
    115/115, 123/123 and 108/109 here.
    """
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)

    def copies(count):
        sources = [np.append(rng.integers(4, 20, size=rng.integers(3, 9)), 3).astype("int32") for _ in range(count)]
        return sources, [np.concatenate([[2], source]).astype("int32") for source in sources]

    model = kt.TransformerModel(vocabulary_size=20, num_layers=1, num_heads=4, hidden_dim=64, intermediate_dim=128,
                                dropout=0.0, max_sequence_length=16)
    training.compile_model(model, warmup_steps=100, learning_rate_scale=0.5, label_smoothing=0.1)
    model.fit(data.make_dataset(*copies(2000), tokens_per_batch=640, seed=0, repeat=True), epochs=1,
              steps_per_epoch=300, verbose=0)
    sources, targets = copies(20)
    source_ids = np.zeros((20, 9), np.int32)
    target_ids = np.zeros((20, 10), np.int32)
    for row, (source, target) in enumerate(zip(sources, targets)):
        source_ids[row, : len(source)], target_ids[row, : len(target)] = source, target
    attention = model.alignment_attention(source_ids, target_ids)
    alignments = [hard_alignment(attention[row], len(source), len(source) - 1) for row, source in enumerate(sources)]
    tokens = sum(len(alignment) for alignment in alignments)
    diagonal = sum(position == index for alignment in alignments for index, position in enumerate(alignment))
    assert diagonal >= 0.95 * tokens, (diagonal, tokens, alignments)
