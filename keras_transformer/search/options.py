"""`SearchOptions`: the search's options as one value, checked once when it is made.

NumPy and the standard library only (through `keras_transformer.decoding`):
the ONNX Runtime library and server (`export.runtime`, `export.serve`) make
and pass the same value without Keras.

Every entry point takes the options either as `options=SearchOptions(...)`
or as its `**search_keywords` (`beam_size=`, `length_penalty=`, ...: the
fields of `SearchOptions`, documented there), never both: `call_options`
refuses an unknown keyword, and `resolve` makes the value of the keywords,
or returns `options` when every search keyword is left at its default.
"""

import dataclasses

from keras_transformer.decoding import check_hypotheses_args, check_search_args, hypotheses_plan
from keras_transformer.utils import is_integer


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """The options of one search: beam or greedy search, its stopping rule, n-best and sampling.

    The one place the search options are listed and documented: every entry
    point (`Translator.translate*`, `generate*`, `OnnxSeq2Seq.generate*`)
    takes this value as `options=`, or its fields as `**search_keywords`.

    Checked when made: a bad value raises `ValueError` with one line naming
    the option, the value received and what is allowed (the messages of
    `decoding.check_search_args` and `check_hypotheses_args`). Frozen and
    hashable: the server batches requests with equal options together.

    Args:
        beam_size: int >= 1; 1 is greedy search. Defaults to 4 (the paper).
        length_penalty: float alpha >= 0 (GNMT's). Defaults to 0.6 (the paper).
        max_extra_length: int >= 0, output tokens beyond the source length.
            Defaults to 50 (the paper).
        patience: None (the exact beam search) or a number > 0: a row stops
            once `round(beam_size * patience)` hypotheses ended (CTranslate2's).
        num_hypotheses: None (one output per source: `translate`,
            `generate`) or an int >= 1, the outputs per source of
            `translate_hypotheses` / `generate_hypotheses` (at most
            `beam_size` unless sampling).
        sampling_topk: int >= 0; 1 (the default) is no sampling, otherwise
            each token is drawn from the k most probable (0: all), with
            `beam_size=1`.
        sampling_topp: float in (0, 1], the probability mass kept when sampling.
        sampling_temperature: float > 0, divides the log-probabilities when sampling.
        seed: int in `[0, 2^31 - 2]`, the draws' seed.

    Example:
    >>> options = SearchOptions(beam_size=1, sampling_topk=10, seed=1)
    >>> translator.translate(["A sentence."], options=options)  # as beam_size=1, sampling_topk=10, seed=1
    >>> SearchOptions(beam_size=0)
    ValueError: beam_size=0 must be an integer >= 1 (1 is greedy search)
    """

    beam_size: int = 4
    length_penalty: float = 0.6
    max_extra_length: int = 50
    patience: float = None
    num_hypotheses: int = None
    sampling_topk: int = 1
    sampling_topp: float = 1.0
    sampling_temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_search_args(self.beam_size, self.length_penalty, self.max_extra_length, self.patience)
        check_hypotheses_args(
            self.beam_size, self.count, self.sampling_topk, self.sampling_topp, self.sampling_temperature, self.seed
        )

    @property
    def sampling(self):
        """Whether the search samples (`sampling_topk != 1`)."""
        return self.sampling_topk != 1

    @property
    def count(self):
        """The outputs per source: `num_hypotheses`, or 1 when it is None."""
        return 1 if self.num_hypotheses is None else self.num_hypotheses

    def search_args(self):
        """The search keywords of a model's own `generate` / `generate_hypotheses` (the decoding protocol).

        `beam_size`, `length_penalty`, `max_extra_length`; `patience` when
        set and the sampling options when sampling (so a model whose
        `generate` lacks them still takes the default search).
        """
        args = dict(beam_size=self.beam_size, length_penalty=self.length_penalty,
                    max_extra_length=self.max_extra_length)
        if self.patience is not None:
            args.update(patience=self.patience)
        if self.sampling:
            args.update(sampling_topk=self.sampling_topk, sampling_topp=self.sampling_topp,
                        sampling_temperature=self.sampling_temperature, seed=self.seed)
        return args

    def plan(self, source, prefix=None):
        """`decoding.hypotheses_plan` of a batch with these options."""
        return hypotheses_plan(
            source, prefix, self.beam_size, self.count, self.sampling_topk, self.sampling_topp,
            self.sampling_temperature, self.seed, self.patience,
        )


DEFAULTS = {field.name: field.default for field in dataclasses.fields(SearchOptions)}
# The search keywords each kind of entry point takes: all of them (`*_hypotheses`); all but `num_hypotheses`
# (one output per source: `translate*`); the beam search's own (`generate`).
FIELDS = tuple(DEFAULTS)
ONE_PER_SOURCE = tuple(name for name in FIELDS if name != "num_hypotheses")
BEAM = ("beam_size", "length_penalty", "max_extra_length", "patience")


def call_options(method, options, search_keywords, allowed=FIELDS):
    """The `SearchOptions` of a call taking `options=None, **search_keywords`: `resolve`, unknown keywords refused.

    Args:
        method: str, the call's name for the message (e.g. "translate").
        options: None or a `SearchOptions`.
        search_keywords: dict, the call's `**search_keywords`.
        allowed: the `SearchOptions` fields the call takes as keywords.

    Raises:
        TypeError: a keyword not in `allowed`, in one line naming it and
            the valid ones (as Python's "unexpected keyword argument").
        ValueError: as `resolve`.
    """
    unknown = [name for name in search_keywords if name not in allowed]
    if unknown:
        raise TypeError(
            f"{method}() got an unexpected keyword argument {unknown[0]!r}; "
            f"its search keywords (SearchOptions fields) are {', '.join(allowed)}"
        )
    return resolve(options, **search_keywords)


def resolve(options=None, **keywords):
    """The `SearchOptions` of a call: `options`, or one made of the call's search keywords.

    One or the other: with `options`, every keyword must be at its
    `SearchOptions` default (a keyword at its default is indistinguishable
    from one left out; `num_hypotheses` 1 counts as its default, None).

    Args:
        options: None or a `SearchOptions`.
        **keywords: the call's search keywords (`SearchOptions` fields).

    Raises:
        TypeError: `options` is not a `SearchOptions`.
        ValueError: `options` with a keyword off its default, or a bad
            keyword value (`SearchOptions`' own message).
    """
    if is_integer(keywords.get("num_hypotheses")) and keywords["num_hypotheses"] == 1:
        keywords["num_hypotheses"] = None  # the `*_hypotheses` methods' default: one each
    if options is None:
        return SearchOptions(**keywords)
    if not isinstance(options, SearchOptions):
        raise TypeError(f"options must be a SearchOptions or None, received {type(options).__name__}")
    given = [f"{name}={value!r}" for name, value in keywords.items() if not _is_default(value, DEFAULTS[name])]
    if given:
        raise ValueError(
            f"pass the search options as options= or as keywords, not both: received options and {', '.join(given)}"
        )
    return options


def _is_default(value, default):
    if value is None or default is None:
        return value is default
    return type(value) is not bool and value == default


def refuse_hypotheses(options, method, other):
    """Refuses `options.num_hypotheses` > 1 in a call that gives one output per source (`translate`, `generate`)."""
    if options.count != 1:
        raise ValueError(
            f"{method} gives one output per source, received options.num_hypotheses={options.num_hypotheses}; "
            f"call {other} for more"
        )


def search_keywords(values):
    """The search keywords among a call's arguments (`locals()` at its start): the `SearchOptions` fields."""
    return {name: values[name] for name in DEFAULTS if name in values}
