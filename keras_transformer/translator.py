"""Text in, text out: tokenizer + model + search, and scores of given translations.

No training framework is imported here: the ONNX Runtime server
(`export.runtime.OnnxTranslator`) uses this class too.
"""

import contextlib
import copy
import functools
import inspect
import itertools
import logging
import os
from typing import NamedTuple

import numpy as np

from keras_transformer import documents
from keras_transformer.alignment import hard_alignment, word_alignment
from keras_transformer.decoding import LENGTH_BUCKET, check_prefix_length
from keras_transformer.search.options import FIELDS, ONE_PER_SOURCE, call_options, refuse_hypotheses
from keras_transformer.search.scoring import score_targets
from keras_transformer.textio import check_output_path, check_text_file, count_lines, iter_lines, write_lines
from keras_transformer.token_ids import encoder_vocabulary_size

logger = logging.getLogger(__name__)

# Sentences per search when neither `batch_size` nor `max_batch_tokens` is given.
DEFAULT_BATCH_SIZE = 32
# Lines that `translate_iterable` and `translate_file` read, sort and translate together.
DEFAULT_WINDOW = 10_000


class TargetScore(NamedTuple):
    """The score of one target given its source (`Translator.score`).

    Attributes:
        log_prob: float, log P(target | source): the sum of `token_log_probs`.
        token_log_probs: list of float, one per target token, the end token
            included.
        token_ids: list of int, the target's token ids (the end id last),
            which `token_log_probs` scores.
    """

    log_prob: float
    token_log_probs: list
    token_ids: list


class Hypothesis(NamedTuple):
    """One output of the search for a text (`Translator.translate_hypotheses`).

    Attributes:
        text: str, the translation.
        token_ids: list of int, its token ids (the end id last).
        log_prob: float, log P(token_ids | source) under the search's token
            rule: what `Translator.score` gives the same ids.
        score: float, the search's score: `log_prob` divided by the GNMT
            length penalty `length_penalty_factor(len(token_ids), alpha)`.
        alignment: None, or with `return_alignment=True` a list with, for
            each token of `token_ids` but the end id, the position of its
            source token in the source's ids (`keras_transformer.alignment`).
        word_alignment: None, or with `return_alignment=True` a list of
            `alignment.WordAlignment(target, source)`, one per word of `text`:
            its `(start, end)` characters in `text` and those of the source
            words it aligns to in the source text.
    """

    text: str
    token_ids: list
    log_prob: float
    score: float
    alignment: list = None
    word_alignment: list = None


class _NoBar:
    """What `_progress_bar` returns without a bar: counts nothing, imports nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def update(self, n=1):
        pass


def _progress_bar(progress, **kwargs):
    """A tqdm bar on stderr when `progress` is true; tqdm is imported only then (it adds to a server's start-up).

    `progress` may also be the caller's own counter (anything with
    `update(n)`, such as a tqdm bar or `progress.CountProgress`), which is
    then told the sentences done and left open.
    """
    if callable(getattr(progress, "update", None)):
        return contextlib.nullcontext(progress)
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(**kwargs)


def check_batch_limits(batch_size, max_batch_tokens):
    """Refuses a `batch_size` or `max_batch_tokens` that is neither None nor a positive integer."""
    for name, value in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer or None")


def length_batches(lengths, batch_size=None, max_batch_tokens=None):
    """Groups items into batches of similar length, longest first.

    Items are sorted by length (longest first; equal lengths keep their
    order), then cut into batches of at most `batch_size` items whose padded
    size, items x the longest length rounded up to a multiple of
    `LENGTH_BUCKET` (as the search pads sources), is at most
    `max_batch_tokens`. An item longer than `max_batch_tokens` is a batch
    of its own. With neither limit, `DEFAULT_BATCH_SIZE` items per batch.
    Rounding to the bucket keeps the number of distinct batch shapes (each
    compiled once on TensorFlow and JAX) near the number of length buckets.

    Args:
        lengths: list of int, e.g. the source tokens of each sentence.
        batch_size: int >= 1 or None, items per batch.
        max_batch_tokens: int >= 1 or None, padded tokens per batch.

    Returns:
        list of lists of indices into `lengths`; every index once.

    Example:
    >>> length_batches([3, 20, 5, 9], max_batch_tokens=32)
    [[1], [3, 2], [0]]
    """
    check_batch_limits(batch_size, max_batch_tokens)
    if batch_size is None and max_batch_tokens is None:
        batch_size = DEFAULT_BATCH_SIZE
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, start = [], 0
    while start < len(order):
        rows = len(order) - start if batch_size is None else batch_size
        if max_batch_tokens is not None:
            padded = -(-max(lengths[order[start]], 1) // LENGTH_BUCKET) * LENGTH_BUCKET
            rows = min(rows, max(1, max_batch_tokens // padded))
        batches.append(order[start: start + rows])
        start += rows
    return batches


class Translator:
    """Translates sentences with a model and its tokenizer.

    Sentences are tokenized as the training pipeline does for sources
    (tokens + end id, no start id), sorted by length into batches
    (`length_batches`: less padding, fewer distinct shapes to compile) of
    `batch_size` sentences or `max_batch_tokens` tokens, searched with
    the model's `generate` (`TransformerModel.generate`, or
    `OnnxSeq2Seq.generate` with the same arguments and tokens), decoded, and
    returned in the input order. Empty (or whitespace-only) strings give empty strings
    without running the model. `translate_file` streams a file of any size
    through the same batches; `score` gives the log-probability of given
    translations; `translate_hypotheses` the n best translations with their
    scores. `target_prefix` (the output starts with given text) and
    sampling (`sampling_topk`, `sampling_topp`, `sampling_temperature`,
    `seed`) run the model's `generate_hypotheses` (`TransformerModel` and
    `OnnxSeq2Seq` alike; `generation.generate_hypotheses` documents them).
    Every method that searches takes its search options as keywords or as
    one `SearchOptions` (`options=`), checked once, before anything is
    translated, and handed to the model's search as that one value.

    The model may be a `TransformerModel`, the ONNX Runtime
    `export.runtime.OnnxSeq2Seq`, or any object implementing the decoding
    protocol of `keras_transformer.generation` (searched with its
    `generate`), so one class serves them all.

    Args:
        model: a `TransformerModel` or another decoding-protocol object.
        tokenizer: a `keras_transformer.tokenizer.Tokenizer` whose vocabulary
            and special ids match the model's.

    Example:
    >>> translator = Translator.from_preset("path/to/preset")
    >>> translator.translate(["A sentence."], beam_size=4)
    ['Ein Satz.']
    >>> translator.translate_hypotheses(["A sentence."], beam_size=4, num_hypotheses=2)[0][0].text
    'Ein Satz.'
    >>> translator.translate_hypotheses(["A sentence."], return_alignment=True)[0][0].word_alignment
    [WordAlignment(target=(0, 3), source=((0, 1),)), WordAlignment(target=(4, 9), source=((2, 11),))]
    >>> translator.translate(["A sentence."], target_prefix=["Einen"])
    ['Einen Satz.']
    >>> translator.translate(["A sentence."], beam_size=1, sampling_topk=10, seed=1)
    ['Ein Satz!']
    >>> translator.translate(["A sentence."], options=SearchOptions(beam_size=1, sampling_topk=10, seed=1))
    ['Ein Satz!']
    >>> scores = translator.score(["A sentence."], ["Ein Satz."])  # [TargetScore(log_prob, ...)]
    >>> translator.translate_file("test.en.gz", "test.de", max_batch_tokens=4096)  # lines written
    946
    """

    def __init__(self, model, tokenizer):
        if tokenizer is None:
            raise ValueError("Translator needs a tokenizer, received None")
        if tokenizer.vocabulary_size != model.vocabulary_size:
            raise ValueError(
                f"The tokenizer has {tokenizer.vocabulary_size} pieces but the model's "
                f"vocabulary_size is {model.vocabulary_size}; use the tokenizer the model was trained with"
            )
        source_size = getattr(tokenizer, "source_vocabulary_size", None) or tokenizer.vocabulary_size
        model_source_size = encoder_vocabulary_size(model)
        if source_size != model_source_size:
            raise ValueError(
                f"The tokenizer has {source_size} source pieces but the model's encoder takes {model_source_size} "
                "ids (source_vocabulary_size); use the tokenizer the model was trained with"
            )
        for name in ("pad_id", "start_id", "end_id"):
            if getattr(tokenizer, name) != getattr(model, name):
                raise ValueError(
                    f"The tokenizer's {name}={getattr(tokenizer, name)} differs from the model's "
                    f"{name}={getattr(model, name)}"
                )
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def from_preset(cls, preset, **overrides):
        """A translator from a preset directory or a pretrained checkpoint, with its tokenizer.

        Args:
            preset: a directory written by `TransformerModel.save_to_preset`
                with a tokenizer, a named pretrained preset (e.g.
                "opus_mt_en_de"), a Hugging Face Marian or NLLB-200 checkpoint
                directory or an "hf://org/name" handle (see
                `TransformerModel.from_preset`; an NLLB model translates with
                `source_language=` and `target_language=`).
            **overrides: passed to `TransformerModel.from_preset`, with
                `quantize="int8"` for Keras' int8 (`TransformerModel.quantize`).

        Raises:
            ValueError: when the preset has no tokenizer (built-in preset
                names such as "base" have none).
        """
        from keras_transformer.model import TransformerModel
        from keras_transformer.presets import TOKENIZER_FILE

        model = TransformerModel.from_preset(preset, **overrides)
        if model.tokenizer is None:
            where = (
                f"the directory {os.fspath(preset)!r} has no tokenizer ({TOKENIZER_FILE})"
                if os.path.isdir(preset)
                else f"{preset!r} is a built-in architecture preset (random weights, no tokenizer)"
            )
            raise ValueError(
                f"Cannot translate with preset {os.fspath(preset)!r}: {where}. Use a directory "
                "written by save_to_preset(directory, tokenizer=...)."
            )
        return cls(model, model.tokenizer)

    def with_languages(self, source_language=None, target_language=None):
        """This translator for a language pair: a multilingual model's (NLLB-200's) codes, e.g. "eng_Latn".

        The tokenizer is bound to the pair (`NllbTokenizer.with_languages`):
        sources start with the source code, and every translation with the
        target code (Hugging Face's `forced_bos_token_id`). A model of one
        language pair takes neither (both None: this translator).

        Raises:
            ValueError: one line naming the codes: a multilingual model
                without both languages, or an unknown code; a language
                given to a model that has no language codes.
        """
        tokenizer = bind_languages(self.tokenizer, source_language, target_language)
        if tokenizer is self.tokenizer:
            return self
        bound = copy.copy(self)  # the same model (and, for a subclass such as OnnxTranslator, its other state)
        bound.tokenizer = tokenizer
        return bound

    def encode(self, texts, first_index=0):
        """Source ids as training sees them: tokens + end id, no start id.

        Sources longer than the model's `max_sequence_length` are cut (the
        end id kept) with a warning naming the sentence (numbered from
        `first_index`).

        Returns:
            list of lists of int.
        """
        sources = self.tokenizer.encode(list(texts), add_start=False, add_end=True)
        limit = getattr(self.model, "max_sequence_length", None)
        if limit is not None:
            for i, ids in enumerate(sources):
                if len(ids) > limit:
                    logger.warning(
                        "Sentence %d has %d tokens; keeping the first %d (max_sequence_length=%d)",
                        first_index + i, len(ids), limit - 1, limit,
                    )
                    sources[i] = ids[: limit - 1] + [self.tokenizer.end_id]
        return sources

    # ------------------------------------------------------------------ #
    # Translation
    # ------------------------------------------------------------------ #
    def translate(
        self,
        texts,
        *,
        options=None,
        batch_size=None,
        max_batch_tokens=None,
        progress=False,
        target_prefix=None,
        split_sentences=False,
        source_language=None,
        target_language=None,
        cancelled=None,
        finished=None,
        **search_keywords,
    ):
        """Translates a list of sentences (or of documents, with `split_sentences`).

        Args:
            texts: list of str (a single str is treated as a list of one).
            options: None, or a `SearchOptions` (its fields document the
                search options).
            **search_keywords: instead of `options` (one or the other):
                `SearchOptions` fields but `num_hypotheses` (`beam_size=`,
                `length_penalty=`, `sampling_topk=`, ...); an unknown one is
                a TypeError.
            batch_size: int >= 1 or None, sentences per search. None:
                `DEFAULT_BATCH_SIZE` (32), or no limit when
                `max_batch_tokens` is given.
            progress: bool, show a tqdm progress bar (on stderr); or an
                object with `update(n)` (a tqdm bar, `CountProgress`) told
                the number of sentences done after each batch.
            max_batch_tokens: int >= 1 or None, padded source tokens per
                search (see `length_batches`).
            target_prefix: None, or one str or None per text: the
                translation starts with the prefix's tokens and the search
                continues from there (at most `max_sequence_length - 2`
                tokens).
            split_sentences: False (the default: each text is one
                sentence), True, or a language code such as "de": each text
                is cut into sentences (`documents.split_texts`: lines at
                "\\n", then sentencex's rules, English ones for True or the
                language's), all of them are translated in one batched
                search, and each text is rebuilt with its own whitespace,
                newlines and paragraph breaks around the translations. A
                sentence longer than the model's `max_sequence_length` is
                cut at a clause boundary (`documents.cut_to_fit`) instead of
                truncated. Not with `target_prefix`.
            source_language, target_language: a multilingual model's (NLLB-200's)
                language codes, e.g. "eng_Latn" and "fra_Latn" (`with_languages`);
                required there, refused elsewhere.
            cancelled: None, or a callable that returns None or one bool
                per text, true for the texts nobody waits for any more (a
                server's client left). A model whose search can drop rows
                (`OnnxSeq2Seq`'s step driver) asks it after each step and
                stops searching those texts at once; they translate to "".
                Other models search them to the end. Not with
                `split_sentences`.
            finished: None, or a callable told each text's translation as
                soon as it is final, `finished(index, translation)`, once per
                text, in the thread that translates: a model whose search
                reports rows as they end (`OnnxSeq2Seq`'s step driver) tells
                each text when its row leaves the search, others when its
                batch is done (an empty text at once). Not with
                `split_sentences`.

        Returns:
            list of str, in the order of `texts`.

        Raises:
            ValueError: naming the argument, before anything is translated.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        texts = _texts(texts, "texts")
        options = _search_options("translate", options, search_keywords, batch_size, max_batch_tokens)
        if split_sentences is not False:
            _check_split_sentences(split_sentences, target_prefix)
            for name, given in (("cancelled", cancelled), ("finished", finished)):
                if given is not None:
                    raise ValueError(f"{name} cannot be used with split_sentences (it is per text, not per sentence)")
            split = self.split_texts(texts, split_sentences)
            with _progress_bar(progress, total=len(split.units), desc="Translating", unit=" sentences") as bar:
                return split.join(self._translate(split.units, options, batch_size, max_batch_tokens, bar))
        prefixes = self._prefixes(target_prefix, texts)
        with _progress_bar(progress, total=len(texts), desc="Translating", unit=" sentences") as bar:
            return self._translate(
                texts, options, batch_size, max_batch_tokens, bar, prefixes=prefixes, cancelled=cancelled,
                finished=finished,
            )

    def split_texts(self, texts, split_sentences=True):
        """`documents.split_texts` of `texts` (each checked to be a str), parts cut to the model's source limit.

        Args:
            texts: list of str.
            split_sentences: True (sentencex's English rules) or a
                language code.

        Returns:
            a `documents.Split`: `.units` to translate, `.join(translations)`.
        """
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, received {type(text).__name__}: {text!r}")
        language = documents.GENERIC_LANGUAGE if split_sentences is True else split_sentences
        limit = getattr(self.model, "max_sequence_length", None)

        def fits(part):  # the source ids (tokens + end id) within the model's positions
            return len(self.tokenizer.encode([part], add_start=False, add_end=True)[0]) <= limit

        return documents.split_texts(texts, language, fits=fits if limit is not None else None)

    def translate_hypotheses(
        self,
        texts,
        *,
        options=None,
        batch_size=None,
        max_batch_tokens=None,
        progress=False,
        target_prefix=None,
        source_language=None,
        target_language=None,
        cancelled=None,
        finished=None,
        return_alignment=False,
        **search_keywords,
    ):
        """The `num_hypotheses` best translations of each sentence, with their scores (and alignments).

        Beam search's `num_hypotheses` best finished hypotheses (distinct,
        best first; the first is `translate`'s translation), or with
        sampling `num_hypotheses` samples sorted by score (they may repeat).
        Greedy search (`beam_size=1`) has one.

        With `return_alignment=True`, each hypothesis also gets its word
        alignment: for each target token, the source token of largest
        weight in the last decoder layer's cross-attention averaged over its
        heads, the source's end token left out (fairseq's and CTranslate2's
        rule; `keras_transformer.alignment`), and per target word the
        aligned source words as character spans. The weights are those the
        decoder gives the finished hypothesis (decoded once more, teacher
        forced: the same as along its beam history), so the search itself
        runs as without alignments.

        Args:
            texts: list of non-empty str (a single str is a list of one).
            options: as `translate`; its `num_hypotheses` (None: 1) is the
                number of hypotheses per text.
            **search_keywords: instead of `options`: any `SearchOptions`
                field, `num_hypotheses` (int >= 1, at most `beam_size`
                unless sampling) included.
            batch_size, max_batch_tokens, progress, target_prefix: as `translate`.
            source_language, target_language: a multilingual model's (NLLB-200's)
                language codes, e.g. "eng_Latn" and "fra_Latn" (`with_languages`);
                required there, refused elsewhere.
            cancelled: as `translate`; a cancelled text gets no hypotheses.
            finished: as `translate`, told each text's hypotheses (with `return_alignment`, its batch's
                once aligned).
            return_alignment: bool, fill each hypothesis' `alignment` and
                `word_alignment`. The model must give its cross-attention
                (`alignment_attention`: a `TransformerModel`, or an ONNX
                export with the fused decoder step).

        Returns:
            list (one per text, in order) of lists of `Hypothesis(text,
            token_ids, log_prob, score)`, best first; a slot the search
            could not fill (a prefix that leaves fewer live beams than
            hypotheses) is left out.

        Raises:
            ValueError: naming the argument (an empty text,
                `num_hypotheses > beam_size`, a prefix too long, alignments
                from a model without attention weights, ...), before
                anything is translated.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        texts = _texts(texts, "texts")
        options = _search_options("translate_hypotheses", options, search_keywords, batch_size, max_batch_tokens)
        self._check_alignment(return_alignment)
        for i, text in enumerate(texts):
            if not text.strip():
                raise ValueError(f"texts[{i}] is empty; translate_hypotheses needs a non-empty text")
        prefixes = self._prefixes(target_prefix, texts)
        with _progress_bar(progress, total=len(texts), desc="Translating", unit=" sentences") as bar:
            return self._translate(
                texts, options, batch_size, max_batch_tokens, bar, prefixes=prefixes, num_hypotheses=options.count,
                cancelled=cancelled, finished=finished, align=return_alignment,
            )

    def translate_iterable(
        self,
        texts,
        *,
        options=None,
        batch_size=None,
        max_batch_tokens=None,
        progress=False,
        window=DEFAULT_WINDOW,
        total=None,
        split_sentences=False,
        source_language=None,
        target_language=None,
        **search_keywords,
    ):
        """Translates a stream of sentences; yields the translations in input order.

        Reads `window` sentences at a time, sorts them by length into
        batches (`length_batches`) and yields their translations before
        reading on, so memory is bounded by the window, not the stream.
        The arguments are checked when this is called, not when the first
        translation is asked for.

        Args:
            texts: an iterable of str (e.g. `textio.iter_lines(path)`).
            window: int >= 1, sentences sorted together (more: fuller,
                better sorted batches and more memory). Defaults to
                `DEFAULT_WINDOW`.
            total: int or None, the number of sentences, for the progress
                bar's ETA.
            options, **search_keywords: as `translate`.
            batch_size, max_batch_tokens, progress: as `translate`.
            split_sentences: as `translate`: each text of the stream is cut
                into sentences and rebuilt (`window` counts texts; the
                progress bar counts sentences).
            source_language, target_language: a multilingual model's (NLLB-200's)
                language codes, e.g. "eng_Latn" and "fra_Latn" (`with_languages`);
                required there, refused elsewhere.

        Returns:
            An iterator of str, one per input sentence.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        options = _search_options("translate_iterable", options, search_keywords, batch_size, max_batch_tokens)
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window={window!r} must be a positive integer (sentences sorted together)")
        if split_sentences is not False:
            _check_split_sentences(split_sentences, None)
            total = None  # the bar counts sentences, whose number is not known ahead
        if isinstance(texts, str):
            texts = [texts]
        return self._stream(
            iter(texts), options, batch_size, max_batch_tokens, int(window), progress, total, split_sentences
        )

    def translate_file(
        self,
        src_path,
        out_path,
        *,
        options=None,
        batch_size=None,
        max_batch_tokens=None,
        progress=False,
        window=DEFAULT_WINDOW,
        overwrite=False,
        split_sentences=False,
        source_language=None,
        target_language=None,
        **search_keywords,
    ):
        """Translates a file of any size, one sentence per line, into another.

        The input is streamed (`textio.iter_lines`: UTF-8, plain or `.gz`,
        lines end at "\\n" only; "-" is stdin) through `translate_iterable`:
        `window` lines at a time are sorted by length into batches of
        `batch_size` sentences or `max_batch_tokens` source tokens, and
        their translations are written in input order, one line per input
        line (empty lines stay empty). The output is written to a temporary
        file beside `out_path` and renamed when complete
        (`textio.write_lines`): a failed or killed run leaves no partial
        `out_path`. The paths are checked before anything is translated.

        Args:
            src_path: the input file (str or path-like), or "-" for stdin.
            out_path: the output file; its directory must exist.
            overwrite: bool, replace an existing `out_path`.
            progress: bool, a tqdm progress bar on stderr (sentences/s;
                with the total for a file).
            options, **search_keywords: as `translate`.
            batch_size, max_batch_tokens, window: as `translate_iterable`.
            split_sentences: as `translate`: each line may hold several
                sentences; it is translated sentence by sentence and
                written back as one line.
            source_language, target_language: a multilingual model's (NLLB-200's)
                language codes, e.g. "eng_Latn" and "fra_Latn" (`with_languages`);
                required there, refused elsewhere.

        Returns:
            int, the number of lines written.

        Raises:
            FileNotFoundError: `src_path` does not exist, or the directory
                of `out_path` does not.
            FileExistsError: `out_path` exists and `overwrite` is False.
            ValueError: bad arguments; `src_path` is binary or not UTF-8;
                `out_path` is `src_path`.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        options = _search_options("translate_file", options, search_keywords, batch_size, max_batch_tokens)
        check_text_file(src_path, "src_path")
        check_output_path(out_path, "out_path", overwrite=overwrite, source=src_path)
        if split_sentences is not False:
            _check_split_sentences(split_sentences, None)
        total = count_lines(src_path) if progress and split_sentences is False else None
        translations = self.translate_iterable(
            iter_lines(src_path), batch_size=batch_size, progress=progress, max_batch_tokens=max_batch_tokens,
            window=window, total=total, options=options, split_sentences=split_sentences,
        )
        return write_lines(out_path, translations, overwrite=overwrite)

    def _prefixes(self, target_prefix, texts):
        """`encode_target_prefix` with this translator's tokenizer and model."""
        return encode_target_prefix(
            self.tokenizer, target_prefix, texts, getattr(self.model, "max_sequence_length", None)
        )

    def _stream(self, texts, options, batch_size, max_batch_tokens, window, progress, total, split_sentences=False):
        with _progress_bar(progress, total=total, desc="Translating", unit=" sentences") as bar:
            for first in itertools.count(0, window):
                chunk = list(itertools.islice(texts, window))
                if not chunk:
                    return
                if split_sentences is False:
                    yield from self._translate(chunk, options, batch_size, max_batch_tokens, bar, first)
                    continue
                split = self.split_texts(chunk, split_sentences)
                yield from split.join(self._translate(split.units, options, batch_size, max_batch_tokens, bar))

    def _translate(
        self, texts, options, batch_size, max_batch_tokens, bar, first_index=0, prefixes=None, num_hypotheses=None,
        cancelled=None, finished=None, align=False,
    ):
        """Translations of `texts` (a list), batched by `length_batches`; `bar` counts sentences.

        With `num_hypotheses`, lists of `Hypothesis` instead of str (with
        `align`, aligned: `_aligned`); `prefixes`: None or per text None or
        its prefix's token ids; `cancelled`, `finished`: as `translate`'s.
        """
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(
                    f"texts[{first_index + i}] must be a str, received {type(text).__name__}: {text!r}"
                )
        results = ["" if num_hypotheses is None else [] for _ in texts]
        prefixes = with_forced_prefix(self.tokenizer, texts, prefixes)
        sources = self.encode(texts, first_index)
        # Empty strings (nothing but the end id) translate to empty strings.
        todo = [i for i, ids in enumerate(sources) if len(ids) > 1 and texts[i].strip()]
        bar.update(len(texts) - len(todo))
        told = set(todo)  # the texts `finished` has not been told yet

        def tell(i):
            if finished is not None and i in told:
                told.discard(i)
                finished(i, results[i])

        if finished is not None:
            for i in sorted(set(range(len(texts))) - told):
                finished(i, results[i])
        # The plain search (`generate`) unless an option needs generate_hypotheses.
        hypotheses = num_hypotheses is not None or prefixes is not None or options.sampling
        for positions in length_batches([len(sources[i]) for i in todo], batch_size, max_batch_tokens):
            batch = [todo[position] for position in positions]
            ids = _padded([sources[i] for i in batch])
            rows_cancelled = _batch_cancelled(cancelled, batch, len(texts))
            if not hypotheses:

                def ended(rows, sequences, batch=batch):  # rows that left the search, their final tokens
                    for row, text in zip(rows, self.tokenizer.decode(sequences)):
                        results[batch[row]] = text
                        tell(batch[row])

                rows_ended = None if finished is None else ended
                for i, text in zip(batch, self.tokenizer.decode(
                    self._generate(ids, options, rows_cancelled, rows_ended)
                )):
                    results[i] = text
            else:

                def ended(rows, found, batch=batch):  # rows that left the search, their final hypotheses
                    for row, i in enumerate(batch[j] for j in rows):
                        results[i] = self._text_or_hypotheses(found, row, num_hypotheses)
                        tell(i)

                rows_ended = None if finished is None or align else ended  # aligned: told with its batch
                prefix = None if prefixes is None else [prefixes[i] for i in batch]
                found = self._generate_hypotheses(ids, options, prefix, rows_cancelled, rows_ended)
                for row, i in enumerate(batch):
                    results[i] = self._text_or_hypotheses(found, row, num_hypotheses)
                if align:
                    aligned = self._aligned([results[i] for i in batch], [texts[i] for i in batch],
                                            [sources[i] for i in batch])
                    for i, found_hypotheses in zip(batch, aligned):
                        results[i] = found_hypotheses
            for i in batch:  # a model that does not report rows as they end (or alignments): the batch's texts now
                tell(i)
            bar.update(len(batch))
        return results

    def _text_or_hypotheses(self, found, row, num_hypotheses):
        """A row's `Hypothesis` list, or without `num_hypotheses` its translation (a cancelled text has none: "")."""
        hypotheses = self._hypotheses(found, row)
        if num_hypotheses is not None:
            return hypotheses
        return hypotheses[0].text if hypotheses else ""

    def _hypotheses(self, found, row):
        """The `Hypothesis` list of one row of `generate_hypotheses`' output, unfilled slots left out."""
        sequences = found.sequences[row]  # [n, L]
        texts = self.tokenizer.decode(sequences)
        results = []
        for sequence, text, score, log_prob in zip(sequences, texts, found.scores[row], found.log_probs[row]):
            if not np.isfinite(score):
                continue
            ends = np.flatnonzero(sequence[1:] == self.tokenizer.end_id)
            token_ids = sequence[1: int(ends[0]) + 2].tolist() if len(ends) else sequence[1:].tolist()
            results.append(Hypothesis(text, token_ids, float(log_prob), float(score)))
        return results

    def _check_alignment(self, return_alignment):
        """Refuses a `return_alignment` other than a bool, or True for a model that gives no attention weights."""
        if not isinstance(return_alignment, bool):
            raise ValueError(f"return_alignment={return_alignment!r} must be True or False")
        if not return_alignment:
            return
        if not callable(getattr(self.model, "alignment_attention", None)):
            raise ValueError(
                f"return_alignment=True needs the model's cross-attention weights (alignment_attention), which "
                f"{type(self.model).__name__} does not give; use a TransformerModel or an ONNX export "
                "(OnnxTranslator), or leave return_alignment out"
            )
        check = getattr(self.model, "check_alignment", None)  # optional: a model that can refuse before searching
        if callable(check):
            check()

    @functools.cached_property
    def _target_pieces(self):
        """The tokenizer's piece of each target id (`pieces()`), read once."""
        return self.tokenizer.pieces()

    def _aligned(self, hypotheses, texts, sources):
        """`hypotheses` (a list of `Hypothesis` lists, one per text) with `alignment` and `word_alignment` set.

        Every hypothesis of the batch is decoded once more, teacher forced,
        in one call of the model's `alignment_attention`; `sources` are the
        texts' source ids.
        """
        rows = [(i, hypothesis) for i, found in enumerate(hypotheses) for hypothesis in found]
        if not rows:
            return hypotheses
        end_id, pieces = self.tokenizer.end_id, self._target_pieces
        attention = self.model.alignment_attention(
            _padded([sources[i] for i, _ in rows]),
            _padded([[self.tokenizer.start_id, *hypothesis.token_ids] for _, hypothesis in rows]),
        )  # [R, T, S]
        aligned = [[] for _ in hypotheses]
        source_pieces = [self.tokenizer.source_pieces(text) for text in texts]
        for row, (i, hypothesis) in enumerate(rows):
            tokens = hypothesis.token_ids[:-1] if hypothesis.token_ids[-1:] == [end_id] else hypothesis.token_ids
            alignment = hard_alignment(attention[row], len(sources[i]), len(tokens))
            words = word_alignment(alignment, source_pieces[i], texts[i], [pieces[t] for t in tokens],
                                   hypothesis.text)
            words = [word for word in words if word.target[0] < word.target[1]]  # pieces with no text (a language code)
            aligned[i].append(hypothesis._replace(alignment=alignment, word_alignment=words))
        return aligned

    def _generate(self, ids, options, cancelled=None, finished=None):
        generate = getattr(self.model, "generate", None)
        if callable(generate):
            return generate(ids, **_model_search_args(generate, options, cancelled, finished))
        from keras_transformer.generation import generate

        return generate(self.model, ids, options=options)

    def _generate_hypotheses(self, ids, options, target_prefix, cancelled=None, finished=None):
        generate_hypotheses = getattr(self.model, "generate_hypotheses", None)
        if callable(generate_hypotheses):
            args = _model_search_args(generate_hypotheses, options, cancelled, finished)
            if "options" not in args:
                args.update(num_hypotheses=options.count)
            return generate_hypotheses(ids, target_prefix=target_prefix, **args)
        from keras_transformer.generation import generate_hypotheses

        return generate_hypotheses(self.model, ids, target_prefix=target_prefix, options=options)

    # ------------------------------------------------------------------ #
    # Scoring
    # ------------------------------------------------------------------ #
    def score(self, sources, targets, batch_size=None, max_batch_tokens=None, progress=False, source_language=None,
              target_language=None):
        """The log-probability of each target given its source, teacher forced.

        Per pair, the target is tokenized as a training target and fed to
        the model's decoder one position at a time, in batches
        (`search.scoring.score_targets`, over the decoding protocol, so
        Keras and ONNX Runtime give the same numbers): each token gets the
        log-probability the search would give it. Scoring greedy search's
        own output gives greedy search's log-probability, when the output
        text tokenizes back into the same pieces (a text is always scored
        by its tokenizer's pieces). Sources are cut to the model's
        `max_sequence_length` as in `translate`.

        Args:
            sources: list of str, non-empty (a single str is a list of one).
            targets: list of str, one per source; "" scores the end token
                alone (the model translating into nothing).
            batch_size, max_batch_tokens: as `translate` (the length of a
                pair is its longer side's).
            progress: bool, a tqdm progress bar on stderr.
            source_language, target_language: as `translate`.

        Returns:
            list of `TargetScore(log_prob, token_log_probs, token_ids)`, in
            the order of the pairs.

        Raises:
            ValueError: different numbers of sources and targets, an empty
                source, a target longer than the model's
                `max_sequence_length`, or bad batch limits.
            TypeError: a source or target that is not a str.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        sources, targets = _texts(sources, "sources"), _texts(targets, "targets")
        if len(sources) != len(targets):
            raise ValueError(
                f"sources has {len(sources)} texts but targets has {len(targets)}; score needs one target per source"
            )
        for i, text in enumerate(sources):
            if not text.strip():
                raise ValueError(
                    f"sources[{i}] is empty; score needs a non-empty source text (an empty target is allowed)"
                )
        check_batch_limits(batch_size, max_batch_tokens)
        source_ids = self.encode(sources)
        target_ids = self.tokenizer.encode(targets, add_start=True, add_end=True, target=True)
        limit = getattr(self.model, "max_sequence_length", None)
        for i, ids in enumerate(target_ids):
            if limit is not None and len(ids) - 1 > limit:
                raise ValueError(
                    f"targets[{i}] has {len(ids) - 1} tokens (the end token included); the model scores at most "
                    f"max_sequence_length={limit}"
                )
        results = [None] * len(sources)
        lengths = [max(len(s), len(t) - 1) for s, t in zip(source_ids, target_ids)]
        with _progress_bar(progress, total=len(sources), desc="Scoring", unit=" pairs") as bar:
            for batch in length_batches(lengths, batch_size, max_batch_tokens):
                log_probs, token_log_probs = score_targets(
                    self.model, _padded([source_ids[i] for i in batch]), _padded([target_ids[i] for i in batch])
                )
                for row, i in enumerate(batch):
                    count = len(target_ids[i]) - 1
                    results[i] = TargetScore(
                        float(log_probs[row]), token_log_probs[row, :count].tolist(), list(target_ids[i][1:])
                    )
                bar.update(len(batch))
        return results


def bind_languages(tokenizer, source_language=None, target_language=None):
    """`tokenizer` bound to a language pair (`Translator.with_languages`' rule), or `tokenizer` itself.

    A multilingual tokenizer (one with `with_languages`: NLLB-200's) needs
    both languages, given here or bound before; a tokenizer of one language
    pair takes neither.

    Raises:
        ValueError: one line naming the codes: a multilingual tokenizer
            without both languages, or an unknown code; a language given to
            a tokenizer that has no language codes.
    """
    bind = getattr(tokenizer, "with_languages", None)
    if bind is None:
        if source_language is None and target_language is None:
            return tokenizer
        given = "source_language" if source_language is not None else "target_language"
        raise ValueError(f"{given}={source_language or target_language!r}: this model translates one language "
                         "pair and has no language codes; leave source_language and target_language out")
    bound = bind(source_language or tokenizer.source_language, target_language or tokenizer.target_language)
    bound.check_language("source_language", bound.source_language)
    bound.check_language("target_language", bound.target_language)
    if (bound.source_language, bound.target_language) == (tokenizer.source_language, tokenizer.target_language):
        return tokenizer
    return bound


def forced_prefix(tokenizer):
    """The ids every translation starts with (a bound multilingual tokenizer's target-language code), or None.

    Hugging Face's `forced_bos_token_id`: the search is given it as a
    target prefix, so Keras, ONNX Runtime and CTranslate2 force it alike.
    """
    if getattr(tokenizer, "target_language", None) is None:
        return None
    return tokenizer.encode([""], add_start=False, add_end=False, target=True)[0]


def with_forced_prefix(tokenizer, texts, prefixes):
    """Per text its target prefix's ids, the forced target-language code where it has none (`forced_prefix`).

    `prefixes`: None or per text None or ids (a prefix encoded as a target
    starts with the code already). Returned unchanged for a tokenizer that
    forces nothing; an empty text keeps None (it is not searched).
    """
    forced = forced_prefix(tokenizer)
    if forced is None:
        return prefixes
    return [(prefixes[i] if prefixes is not None and prefixes[i] else forced) if text.strip() else None
            for i, text in enumerate(texts)]


def encode_target_prefix(tokenizer, target_prefix, texts, max_sequence_length=None, texts_name="texts"):
    """The token ids of each text's target prefix, checked up front (`Translator.translate(target_prefix=...)`).

    Args:
        tokenizer: encodes the prefixes as targets (`encode(..., target=True)`).
        target_prefix: None, one str (for one text), or one str or None per text.
        texts: the source texts.
        max_sequence_length: the model's, or None (no length check).
        texts_name: what the messages call `texts` (the HTTP server's field is `text`).

    Returns:
        None when no text has a prefix; else per text None (no prefix) or
        its prefix's token ids (no start or end id).

    Raises:
        ValueError, TypeError: naming the entry (`target_prefix[i]` is not
            a str or None, has too many tokens, or belongs to an empty text;
            not one entry per text).
    """
    if target_prefix is None:
        return None
    target_prefix = [target_prefix] if isinstance(target_prefix, str) else list(target_prefix)
    if len(target_prefix) != len(texts):
        raise ValueError(
            f"target_prefix has {len(target_prefix)} entries; expected one str or None per text ({len(texts)})"
        )
    for i, prefix in enumerate(target_prefix):
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"target_prefix[{i}] must be a str or None, received {type(prefix).__name__}")
    given = [i for i, prefix in enumerate(target_prefix) if prefix]
    prefixes = [None] * len(texts)
    encoded = tokenizer.encode([target_prefix[i] for i in given], add_start=False, add_end=False, target=True)
    for i, ids in zip(given, encoded):
        check_prefix_length(i, len(ids), max_sequence_length)
        if not texts[i].strip():
            raise ValueError(
                f"{texts_name}[{i}] is empty but target_prefix[{i}] is not; a prefix needs a source text"
            )
        prefixes[i] = ids or None
    return prefixes if any(prefixes) else None


def _search_options(method, options, keywords, batch_size, max_batch_tokens):
    """The call's `SearchOptions` (`call_options`: `options` or its keywords), its batch limits checked after them.

    A `translate*` call other than `translate_hypotheses` gives one output per text: no `num_hypotheses`.
    """
    one_per_text = method != "translate_hypotheses"
    options = call_options(method, options, keywords, ONE_PER_SOURCE if one_per_text else FIELDS)
    check_batch_limits(batch_size, max_batch_tokens)
    if one_per_text:
        refuse_hypotheses(options, "translate", "translate_hypotheses")
    return options


def _model_search_args(method, options, cancelled=None, finished=None):
    """The search arguments of a model's own `generate` or `generate_hypotheses`.

    `options=` when the method takes it (`TransformerModel`,
    `OnnxSeq2Seq`), else its keywords (`SearchOptions.search_args`: a
    decoding-protocol object of its own, which may take only some);
    `cancelled=` and `finished=` when given and the method takes them (`OnnxSeq2Seq`).
    """
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        parameters = {}

    def takes(name):
        return name in parameters and parameters[name].kind != inspect.Parameter.VAR_KEYWORD

    args = {"options": options} if takes("options") else options.search_args()
    for name, given in (("cancelled", cancelled), ("finished", finished)):
        if given is not None and takes(name):
            args[name] = given
    return args


def _batch_cancelled(cancelled, batch, count):
    """`cancelled` (None, or a callable of flags per text of `count`) for the rows of one batch (text indices)."""
    if cancelled is None:
        return None

    def flags():
        found = cancelled()
        if found is None:
            return None
        found = np.asarray(found, bool)
        if found.shape != (count,):
            raise ValueError(f"cancelled() returned {found.shape[0] if found.ndim else found!r} flags for {count} texts")
        return found[batch]

    return flags


def _check_split_sentences(split_sentences, target_prefix):
    """Refuses a `split_sentences` other than False, True or a language code, or one with a target prefix."""
    if not (split_sentences is True or (isinstance(split_sentences, str) and split_sentences.strip())):
        raise ValueError(
            f"split_sentences={split_sentences!r} must be False, True or a language code such as 'en' or 'de'"
        )
    if target_prefix is not None:
        raise ValueError(
            "split_sentences and target_prefix cannot be used together: a prefix starts one sentence's "
            "translation; split the text yourself and give each sentence its prefix"
        )


def _texts(texts, name):
    """`texts` as a list of str (a single str is a list of one); TypeError naming the first that is not."""
    if isinstance(texts, str):
        texts = [texts]
    else:
        try:
            texts = list(texts)
        except TypeError:
            raise TypeError(f"{name} must be a str or a list of str, received {type(texts).__name__}") from None
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, received {type(text).__name__}: {text!r}")
    return texts


def _padded(rows):
    """int32 `[len(rows), longest]`: the rows, then pad ids (0)."""
    ids = np.zeros((len(rows), max(len(row) for row in rows)), "int32")
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids
