"""Translation engines: count a text's source tokens (for batching) and translate a batch of texts.

An engine is any object with `count_tokens(texts) -> list of int` and
`translate(texts, options) -> list of str` (`options`: a `SearchOptions`);
`name` and `directory` are shown in logs and `/ready`; `tokenizer`, where
an engine has one, leads the warm-up sentence with a target-language code
when its vocabulary has them (a multilingual Marian model). An engine that
serves more of a request's fields lists them in `features` (of
`FEATURES`) and has `check_target_prefix(texts, target_prefix)` (the ids, or raises
`ValueError` naming the entry) for "target_prefix"; its `translate` then
takes `target_prefix=` (one str or None per text; passed only when a text
of the batch has one) and, with `options.num_hypotheses`, returns per text
a list of hypotheses (`text`, `score`, `log_prob`), best first. For
"alignment" (and "format", whose units are searched with alignments) it has `check_alignment()` (raises a one-line `ValueError`
where it cannot align) and its `translate` takes `return_alignment=True`:
it then returns per text a list of hypotheses with their `word_alignment`
(`Translator.translate_hypotheses`'), even without `num_hypotheses`. An engine
whose search can drop rows mid-search says `drops_rows = True`; its
`translate` then takes `cancelled=` (`Translator.translate`'s: a callable
that returns None or one bool per text, true for the texts whose request
was abandoned), asked after each step. An engine whose search reports
texts as their rows leave it says `streams_rows = True`; its `translate`
then takes `finished=` (`Translator.translate`'s: `finished(index, result)`
once per text as soon as its result is final, from the search's thread).
Another engine's results are the batch's, when `translate` returns. An
engine whose model may be multilingual has `with_languages(source_language,
target_language)`: the engine bound to a pair (itself for a model of one pair
and no languages; one-line `ValueError` naming the codes otherwise,
`Translator.with_languages`' rule).
"""

import copy
import dataclasses
import json
import os
import pathlib
from typing import NamedTuple

ENGINES = ("onnxruntime", "ctranslate2")
# The request fields beyond `text` and `beam_size` that an engine may serve ("sampling": the sampling_* fields, seed;
# "format": "html"; "alignment": return_alignment).
FEATURES = ("num_hypotheses", "target_prefix", "sampling", "format", "alignment")


class AlignedTranslation(NamedTuple):
    """A CTranslate2 engine's translation with its `word_alignment` (`Hypothesis.word_alignment`'s form)."""

    text: str
    alignment: list
    word_alignment: list


class _TokenizedEngine:
    """What both engines do with their `tokenizer` and `max_sequence_length`."""

    def count_tokens(self, texts):
        """Source tokens of each text, end token included, at most `max_sequence_length` (longer are cut)."""
        return count_tokens(self.tokenizer, self.max_sequence_length, texts)

    def check_target_prefix(self, texts, target_prefix):
        """`check_target_prefix` (below) with this engine's tokenizer."""
        return check_target_prefix(self.tokenizer, self.max_sequence_length, texts, target_prefix)


class OnnxRuntimeEngine(_TokenizedEngine):
    """`export.runtime.OnnxTranslator`: each batch is one `translate` call, so one ONNX Runtime search.

    Args:
        directory: written by `python -m export.onnx` from a preset with a tokenizer.
        threads: ONNX Runtime intra-op threads, or None (one per core).
        providers: as `OnnxSeq2Seq` (None: CUDA when it works, else CPU).
        optimized_cache: as `OnnxSeq2Seq`: a directory for ONNX Runtime's
            optimised graphs (later starts skip the optimisation), or None.
    """

    name = "onnxruntime"
    features = frozenset(FEATURES)
    drops_rows = True  # the step driver (export.steps) drops a cancelled text's rows after the current step
    streams_rows = True  # ... and reports each text's result when its rows leave the search

    def __init__(self, directory, threads=None, providers=None, optimized_cache=None):
        from export.runtime import OnnxTranslator

        self.directory = pathlib.Path(directory)
        self.translator = OnnxTranslator(
            directory, providers=providers, intra_op_threads=threads, optimized_cache=optimized_cache
        )
        self.tokenizer = self.translator.tokenizer
        self.max_sequence_length = self.translator.model.max_sequence_length

    def with_languages(self, source_language=None, target_language=None):
        """This engine with its translator bound to a language pair (`Translator.with_languages`)."""
        translator = self.translator.with_languages(source_language, target_language)
        if translator is self.translator:
            return self
        bound = copy.copy(self)  # the same sessions
        bound.translator, bound.tokenizer = translator, translator.tokenizer
        return bound

    def check_alignment(self):
        """Raises a one-line `ValueError` where this export cannot align (no fused step, or no onnx package)."""
        self.translator.model.check_alignment()

    def translate(self, texts, options, target_prefix=None, cancelled=None, finished=None, return_alignment=False):
        """Translations (or with `options.num_hypotheses` or `return_alignment`, `Hypothesis` lists) of `texts`.

        In one search. `cancelled`: None or `Translator.translate`'s (a cancelled text gets "" or no
        hypotheses); `finished`: None or `Translator.translate`'s.
        """
        batch = dict(batch_size=max(len(texts), 1), target_prefix=target_prefix, cancelled=cancelled, finished=finished)
        if options.num_hypotheses is None and not return_alignment:
            return self.translator.translate(texts, options=options, **batch)
        return self.translator.translate_hypotheses(
            texts, options=dataclasses.replace(options, num_hypotheses=options.count), return_alignment=return_alignment,
            **batch,
        )


class CTranslate2Engine(_TokenizedEngine):
    """A CTranslate2 `Translator` on the directory written by `python -m export.ctranslate2`.

    The directory's tokenizer (`load_tokenizer`) gives our ids, which are
    CTranslate2's tokens by their place in `shared_vocabulary.json`; the
    search settings are `export.ctranslate2.translation_options` and
    `max_decoding_length`. One maximum output length per call (CTranslate2 takes one number): the
    longest source's, so a short sentence batched with a long one may
    generate beyond its own limit when it does not end earlier. The length
    penalty is CTranslate2's (see `export.ctranslate2`): greedy search gives
    the ONNX engine's tokens, beams may differ. It serves `target_prefix`
    (CTranslate2's own) and word alignments (its `return_attention`, whose
    layer and heads the export sets to our rule's: `export.ctranslate2`);
    `num_hypotheses` and sampling are the ONNX engine's only (CTranslate2 scores hypotheses with its own length
    penalty, and its draws depend on the batch, so a seed would not give a
    text the same samples in every batch). It cannot drop rows mid-search
    (`translate_batch` runs a batch to its end): an abandoned request's
    sentences leave the queue only. Nor does it report rows as they end
    (`translate_batch` returns the batch's results together): a streamed
    request gets a batch's sentences when the batch is done.

    Args:
        directory: written by `python -m export.ctranslate2` from a preset with a tokenizer.
        threads: CTranslate2 intra-op threads (default 1: OpenMP threads
            spin, see `export.ctranslate2`).
    """

    name = "ctranslate2"
    features = frozenset({"target_prefix", "alignment"})

    def __init__(self, directory, threads=None):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before ctranslate2 loads OpenMP
        import ctranslate2

        from export.ctranslate2 import (
            SOURCE_VOCABULARY_FILE, TARGET_VOCABULARY_FILE, VOCABULARY_FILE, max_decoding_length, read_metadata,
            translation_options,
        )
        from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME, load_tokenizer

        self.directory = pathlib.Path(directory)
        metadata = read_metadata(self.directory)
        # Ours (tokenizer.model) or an imported checkpoint's (Marian's, NLLB-200's).
        self.tokenizer = load_tokenizer(self.directory)
        if self.tokenizer is None:
            raise FileNotFoundError(
                f"{directory} has no {TOKENIZER_FILENAME} (nor an imported checkpoint's Marian tokenizer); "
                "export a preset directory that holds its tokenizer"
            )
        # One shared vocabulary, or (a model with a source table of its own) CTranslate2's source and target files.
        separate = (self.directory / TARGET_VOCABULARY_FILE).is_file()
        self.tokens = json.loads((self.directory / (TARGET_VOCABULARY_FILE if separate else VOCABULARY_FILE))
                                 .read_text(encoding="utf-8"))
        self.source_tokens = json.loads((self.directory / SOURCE_VOCABULARY_FILE).read_text(encoding="utf-8")) \
            if separate else self.tokens
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.max_sequence_length = int(metadata["max_sequence_length"])
        self._max_decoding_length = max_decoding_length
        self._translation_options = translation_options
        self.translator = ctranslate2.Translator(
            str(self.directory), device="cpu", intra_threads=threads or 1, inter_threads=1
        )

    def with_languages(self, source_language=None, target_language=None):
        """This engine with its tokenizer bound to a language pair (`translator.bind_languages`)."""
        from keras_transformer.translator import bind_languages

        tokenizer = bind_languages(self.tokenizer, source_language, target_language)
        if tokenizer is self.tokenizer:
            return self
        bound = copy.copy(self)  # the same CTranslate2 translator
        bound.tokenizer = tokenizer
        return bound

    def check_alignment(self):
        """Nothing to refuse: CTranslate2 returns the attention of the layer and heads the export chose."""

    def translate(self, texts, options, target_prefix=None, return_alignment=False):
        """Translations of `texts` in one `translate_batch`; with `return_alignment`, per text `[AlignedTranslation]`
        (`[]` for an empty text)."""
        from keras_transformer.translator import with_forced_prefix

        rows = self.tokenizer.encode(texts, add_start=False, add_end=False)
        # A multilingual model's translations start with the target code (CTranslate2's target_prefix).
        prefixes = with_forced_prefix(self.tokenizer, texts, self.check_target_prefix(texts, target_prefix))
        prefixes = prefixes or [None] * len(texts)
        results = [""] * len(texts)
        # Empty texts translate to empty strings without a search, as Translator.translate.
        todo = [i for i, row in enumerate(rows) if row and texts[i].strip()]
        if not todo:
            return [[] for _ in texts] if return_alignment else results
        limit = self.max_sequence_length - 1  # room for the end piece CTranslate2 appends
        pieces = [[self.source_tokens[t] for t in rows[i][:limit]] for i in todo]
        prefix_pieces = [None if prefixes[i] is None else [self.tokens[t] for t in prefixes[i]] for i in todo]
        outputs = self.translator.translate_batch(
            pieces,
            target_prefix=prefix_pieces if any(prefix_pieces) else None,
            max_decoding_length=self._max_decoding_length(
                max(len(row) for row in pieces), self.max_sequence_length, options.max_extra_length
            ),
            return_attention=return_alignment,
            **self._translation_options(
                options.beam_size, options.length_penalty, self.max_sequence_length, options.patience
            ),
        )
        decoded = self.tokenizer.decode([[self.index[token] for token in output.hypotheses[0]] for output in outputs])
        for i, text in zip(todo, decoded):
            results[i] = text
        return self._aligned(texts, todo, pieces, outputs, results) if return_alignment else results

    def _aligned(self, texts, todo, pieces, outputs, results):
        """Per text `[AlignedTranslation]` (`[]` unsearched): `Translator._aligned`'s rule on CTranslate2's attention.

        `attention[0]` is `[T, S]` over the source's pieces without the end
        piece CTranslate2 appends, so its argmax is `hard_alignment`'s.
        """
        from keras_transformer.documents.alignment import hard_alignment, word_alignment

        aligned = [[] for _ in texts]
        for i, source, output in zip(todo, pieces, outputs):
            target = output.hypotheses[0]
            alignment = hard_alignment(output.attention[0], len(source) + 1, len(target))
            words = word_alignment(alignment, self.tokenizer.source_pieces(texts[i]), texts[i], target, results[i])
            words = [word for word in words if word.target[0] < word.target[1]]  # pieces with no text (a code)
            aligned[i] = [AlignedTranslation(results[i], alignment, words)]
        return aligned


def count_tokens(tokenizer, max_sequence_length, texts):
    """Source tokens of each text, end token included, at most `max_sequence_length` (longer are cut)."""
    ids = tokenizer.encode(texts, add_start=False, add_end=True)
    return [min(len(row), max_sequence_length) for row in ids]


def check_target_prefix(tokenizer, max_sequence_length, texts, target_prefix):
    """The prefixes' token ids (`encode_target_prefix`), or `ValueError` / `TypeError` naming the request's entry."""
    from keras_transformer.translator import encode_target_prefix

    return encode_target_prefix(tokenizer, target_prefix, texts, max_sequence_length, texts_name="text")


def load_engine(directory, engine="onnxruntime", threads=None, optimized_cache=None):
    """The translation engine for an exported directory.

    Args:
        directory: `python -m export.onnx` output (engine "onnxruntime") or
            `python -m export.ctranslate2` output (engine "ctranslate2").
        engine: one of `ENGINES`.
        threads: intra-op threads of the engine, or None (its default).
        optimized_cache: ONNX Runtime's optimised-graph cache directory
            (`OnnxRuntimeEngine`), or None; CTranslate2 has none.

    Raises:
        FileNotFoundError, ValueError: the directory is not such an export.
    """
    if engine == "onnxruntime":
        return OnnxRuntimeEngine(directory, threads=threads, optimized_cache=optimized_cache)
    if engine == "ctranslate2":
        return CTranslate2Engine(directory, threads=threads)
    raise ValueError(f"engine={engine!r} must be one of {ENGINES}")
