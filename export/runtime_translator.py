"""`OnnxTranslator`: the `Translator` over an `OnnxSeq2Seq` and the tokenizer stored beside the export."""

import pathlib

from export.runtime_model import OnnxSeq2Seq
from export.runtime_sessions import read_config
from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME, load_tokenizer
from keras_transformer.translator import Translator


class OnnxTranslator(Translator):
    """Text in, text out with an exported model and the tokenizer stored beside it.

    The `Translator` of the Keras side (same tokenization, length-sorted
    batches, truncation, empty lines; `translate_file`, `score`,
    `translate_hypotheses`, target prefixes, sampling) over an
    `OnnxSeq2Seq`: each translated batch is one ONNX Runtime call; `score`
    runs the protocol graphs step by step.

    Args:
        directory: written by `python -m export.onnx` from a preset with a
            tokenizer (`keras_transformer.tokenizers.sentencepiece.load_tokenizer`: ours, or
            an imported Marian or NLLB-200 checkpoint's).
        providers, intra_op_threads, optimized_cache: as `OnnxSeq2Seq`.

    Example:
    >>> OnnxTranslator("exported/onnx").translate(["A sentence."], beam_size=4)
    ['Ein Satz.']
    """

    def __init__(self, directory, providers=None, intra_op_threads=None, optimized_cache=None):
        directory = pathlib.Path(directory)
        read_config(directory)
        tokenizer = load_tokenizer(directory)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{directory} has no {TOKENIZER_FILENAME} (nor an imported checkpoint's tokenizer); export a "
                "preset directory or checkpoint that holds its tokenizer to translate text (OnnxSeq2Seq works on "
                "ids without one)"
            )
        model = OnnxSeq2Seq(
            directory, providers=providers, intra_op_threads=intra_op_threads, optimized_cache=optimized_cache
        )
        super().__init__(model, tokenizer)

    @classmethod
    def from_preset(cls, directory, providers=None, intra_op_threads=None, optimized_cache=None):
        """`OnnxTranslator(directory)`, named as `Translator.from_preset`."""
        return cls(directory, providers=providers, intra_op_threads=intra_op_threads, optimized_cache=optimized_cache)
