"""Text in, text out: tokenizer + model + search, and scores of given translations.

No training framework is imported here: the ONNX Runtime server
(`export.runtime.OnnxTranslator`) uses this class too.
"""

# The result types, batching and language helpers live in `keras_transformer.translation`; the names below are
# plain re-exports, so `keras_transformer.translator.X` keeps importing every name it did.
import copy
import functools
import itertools
import logging
import os

import numpy as np

from keras_transformer import documents
from keras_transformer.documents import markup
from keras_transformer.translation.alignments import aligned_hypotheses, check_alignment
from keras_transformer.translation.batching import (  # noqa: F401 (re-exports)
    DEFAULT_BATCH_SIZE,
    DEFAULT_WINDOW,
    batch_cancelled,
    check_batch_limits,
    check_split_sentences,
    check_texts,
    length_batches,
    padded,
    progress_bar,
)
from keras_transformer.translation.languages import (  # noqa: F401 (re-exports)
    bind_languages,
    encode_target_prefix,
    forced_prefix,
    with_forced_prefix,
)
from keras_transformer.translation.results import Hypothesis, TargetScore, row_hypotheses  # noqa: F401 (re-exports)
from keras_transformer.translation.scoring import score_pairs
from keras_transformer.translation.search import generate_hypotheses, generate_ids, search_options
from keras_transformer.textio import check_output_path, check_text_file, count_lines, iter_lines, write_lines
from keras_transformer.token_ids import encoder_vocabulary_size

logger = logging.getLogger(__name__)

_padded = padded  # the old private name, for code that reached for it


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
        tokenizer: a `keras_transformer.tokenizers.sentencepiece.Tokenizer` whose vocabulary
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
        format="text",
        **search_keywords,
    ):
        """Translates a list of sentences (or of documents, with `split_sentences`; or of HTML, with `format`).

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
            format: "text" (the default) or "html": each text is HTML (a
                fragment or a document) and its translation HTML of the same
                kind: the text of each block is translated as one input (cut
                into sentences with `split_sentences`), inline tags are put
                around the target words aligned to the words they enclosed,
                and markup, entities and untranslatable elements are kept
                (`keras_transformer.documents.markup`). The model must give alignments
                (`return_alignment`). Not with `target_prefix`, `cancelled`
                or `finished`.

        Returns:
            list of str, in the order of `texts`.

        Raises:
            ValueError: naming the argument, before anything is translated.
        """
        self = self.with_languages(source_language, target_language)  # the pair's tokenizer, checked
        texts = check_texts(texts, "texts")
        options = search_options("translate", options, search_keywords, batch_size, max_batch_tokens)
        markup.check_format(format, target_prefix, cancelled=cancelled, finished=finished)
        if split_sentences is not False:
            check_split_sentences(split_sentences, target_prefix)
        if format == "html":
            return self._translate_html(texts, options, batch_size, max_batch_tokens, progress, split_sentences)
        if split_sentences is not False:
            for name, given in (("cancelled", cancelled), ("finished", finished)):
                if given is not None:
                    raise ValueError(f"{name} cannot be used with split_sentences (it is per text, not per sentence)")
            split = self.split_texts(texts, split_sentences)
            with progress_bar(progress, total=len(split.units), desc="Translating", unit=" sentences") as bar:
                return split.join(self._translate(split.units, options, batch_size, max_batch_tokens, bar))
        prefixes = self._prefixes(target_prefix, texts)
        with progress_bar(progress, total=len(texts), desc="Translating", unit=" sentences") as bar:
            return self._translate(
                texts, options, batch_size, max_batch_tokens, bar, prefixes=prefixes, cancelled=cancelled,
                finished=finished,
            )

    def _translate_html(self, texts, options, batch_size, max_batch_tokens, progress, split_sentences):
        """`translate(..., format="html")`: `markup.translate_html` over aligned translations of the units."""
        try:
            check_alignment(self.model, True)
        except ValueError as error:
            raise ValueError(f"format='html' puts inline tags on the aligned words: {error}") from None

        def aligned(units):
            with progress_bar(progress, total=len(units), desc="Translating", unit=" sentences") as bar:
                found = self._translate(units, options, batch_size, max_batch_tokens, bar, num_hypotheses=1,
                                        align=True)
            return [hypotheses[0] if hypotheses else None for hypotheses in found]

        split = None if split_sentences is False else functools.partial(self.split_texts,
                                                                         split_sentences=split_sentences)
        return markup.translate_html(texts, aligned, split)

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
        rule; `keras_transformer.documents.alignment`), and per target word the
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
        texts = check_texts(texts, "texts")
        options = search_options("translate_hypotheses", options, search_keywords, batch_size, max_batch_tokens)
        check_alignment(self.model, return_alignment)
        for i, text in enumerate(texts):
            if not text.strip():
                raise ValueError(f"texts[{i}] is empty; translate_hypotheses needs a non-empty text")
        prefixes = self._prefixes(target_prefix, texts)
        with progress_bar(progress, total=len(texts), desc="Translating", unit=" sentences") as bar:
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
        options = search_options("translate_iterable", options, search_keywords, batch_size, max_batch_tokens)
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window={window!r} must be a positive integer (sentences sorted together)")
        if split_sentences is not False:
            check_split_sentences(split_sentences, None)
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
        options = search_options("translate_file", options, search_keywords, batch_size, max_batch_tokens)
        check_text_file(src_path, "src_path")
        check_output_path(out_path, "out_path", overwrite=overwrite, source=src_path)
        if split_sentences is not False:
            check_split_sentences(split_sentences, None)
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
        with progress_bar(progress, total=total, desc="Translating", unit=" sentences") as bar:
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
            ids = padded([sources[i] for i in batch])
            rows_cancelled = batch_cancelled(cancelled, batch, len(texts))
            if not hypotheses:

                def ended(rows, sequences, batch=batch):  # rows that left the search, their final tokens
                    for row, text in zip(rows, self.tokenizer.decode(sequences)):
                        results[batch[row]] = text
                        tell(batch[row])

                rows_ended = None if finished is None else ended
                for i, text in zip(batch, self.tokenizer.decode(
                    generate_ids(self.model, ids, options, rows_cancelled, rows_ended)
                )):
                    results[i] = text
            else:

                def ended(rows, found, batch=batch):  # rows that left the search, their final hypotheses
                    for row, i in enumerate(batch[j] for j in rows):
                        results[i] = self._text_or_hypotheses(found, row, num_hypotheses)
                        tell(i)

                rows_ended = None if finished is None or align else ended  # aligned: told with its batch
                prefix = None if prefixes is None else [prefixes[i] for i in batch]
                found = generate_hypotheses(self.model, ids, options, prefix, rows_cancelled, rows_ended)
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
        hypotheses = row_hypotheses(self.tokenizer, found, row)
        if num_hypotheses is not None:
            return hypotheses
        return hypotheses[0].text if hypotheses else ""

    @functools.cached_property
    def _target_pieces(self):
        """The tokenizer's piece of each target id (`pieces()`), read once."""
        return self.tokenizer.pieces()

    def _aligned(self, hypotheses, texts, sources):
        """`alignments.aligned_hypotheses` with this translator's model, tokenizer and target pieces."""
        return aligned_hypotheses(self.model, self.tokenizer, self._target_pieces, hypotheses, texts, sources)

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
        return score_pairs(self, sources, targets, batch_size, max_batch_tokens, progress)
