"""What a `/v1/translate` request may say, and what its answer looks like.

Parsing and checking a request body (its fields, their limits, the
`X-Request-Id` rule) into a `Request`, and `RequestError`, the one-line
answer other than 200 that names the field and the limit. `FIELDS` is the
table of fields: a new one is a row there and a check in `read_request`.
"""

import dataclasses
import json
import re
import uuid

from export.serve.engines import FEATURES
from export.serve.settings import SearchOptions
from keras_transformer.utils import is_integer

# Request fields, and the engine feature (engines.FEATURES) each needs.
FIELDS = {
    "text": None, "beam_size": None, "num_hypotheses": "num_hypotheses", "target_prefix": "target_prefix",
    "sampling_topk": "sampling", "sampling_topp": "sampling", "sampling_temperature": "sampling", "seed": "sampling",
    "split_sentences": None, "max_extra_length": None, "timeout_ms": None, "stream": None,
    "source_language": None, "target_language": None, "format": "format", "return_alignment": "alignment",
}
SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SearchOptions) if FIELDS.get(f.name) == "sampling"}
# The status logged for a request whose client went away before its answer (nginx's).
CLIENT_CLOSED = 499
# A client's X-Request-Id is kept when it is 1-128 visible ASCII characters (it goes into log lines as it is).
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")

class RequestError(Exception):
    """An answer other than 200: status, message (the JSON `error`), reason (the metric's label)."""

    def __init__(self, status, message, reason, headers=None):
        super().__init__(message)
        self.status, self.message, self.reason, self.headers = status, message, reason, headers


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def languages_option(payload):
    """The request's `(source_language, target_language)`, or None when it names neither; each a string (400)."""
    languages = tuple(payload.get(name) for name in ("source_language", "target_language"))
    for name, value in zip(("source_language", "target_language"), languages):
        if value is not None and not isinstance(value, str):
            raise RequestError(400, f"{name} must be a language code (a string), received {_json_type(value)}",
                               "bad_request")
    return None if languages == (None, None) else languages


def bound_engine(engine, languages):
    """`engine` for a request's language pair (`with_languages`), or `RequestError` (400) in one line naming the codes.

    A multilingual model's engine needs both languages; any other takes
    neither (an engine without `with_languages` has no language codes).
    """
    bind = getattr(engine, "with_languages", None)
    try:
        if bind is None:
            if languages is not None:
                raise ValueError("source_language / target_language: this model translates one language pair and has "
                                 "no language codes; leave them out")
            return engine
        return bind(*(languages or (None, None)))
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None


def _json_type(value):
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_request(body, settings, engine_name=None, features=FEATURES):
    """`(texts, SearchOptions, target_prefix)` from a request body (bytes), or `RequestError` (400) naming the field.

    `target_prefix` is None or one str or None per text (its tokens are the
    engine's to check). `features`: the engine's (`engines.FEATURES`); a
    field that needs another is refused with 400 naming the engine.

    Example:
    >>> parse_request(b'{"text": ["A sentence."], "beam_size": 2}', ServerSettings())[0]
    ['A sentence.']
    """
    return request_from_payload(parse_payload(body), settings, engine_name, features)


def parse_payload(body):
    """The request body (bytes) as a JSON object (a dict), or `RequestError` (400)."""
    try:
        document = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(400, f"the body is not UTF-8: {error}", "bad_request") from None
    try:
        payload = json.loads(document, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError; so are huge integers
        raise RequestError(400, f"the body is not valid JSON: {error}", "bad_request") from None
    if not isinstance(payload, dict):
        raise RequestError(
            400, f'the body must be a JSON object such as {{"text": ["A sentence."]}}, received {_json_type(payload)}',
            "bad_request",
        )
    return payload


def request_from_payload(payload, settings, engine_name=None, features=FEATURES):
    """`parse_request` of a body already read as a JSON object."""
    for field in payload:
        if field not in FIELDS:
            raise RequestError(400, f"unknown field {field!r}; this server takes {', '.join(FIELDS)}", "bad_request")
        if FIELDS[field] is not None and FIELDS[field] not in features:
            raise RequestError(
                400, f"{field} is not served by the {engine_name or 'this'} engine; the onnxruntime engine serves it",
                "not_supported",
            )
    if "text" not in payload:
        raise RequestError(400, "missing field 'text' (a string or an array of strings)", "bad_request")
    texts = payload["text"]
    single = isinstance(texts, str)
    if single:
        texts = [texts]
    if not isinstance(texts, list):
        raise RequestError(
            400, f"text must be a string or an array of strings, received {_json_type(texts)}", "bad_request"
        )
    if len(texts) > settings.max_texts:
        raise RequestError(
            400, f"text has {len(texts)} items; the limit is {settings.max_texts} (--max-texts)", "too_many_texts"
        )
    for i, text in enumerate(texts):
        _check_text(text, f"text[{i}]", settings)
    target_prefix = _target_prefix(payload, texts, single, settings)
    sampling = {name: payload.get(name, default) for name, default in SAMPLING_DEFAULTS.items()}
    sampled = sampling["sampling_topk"] != 1
    # Sampling draws one token at a time: a request that samples searches with beam_size 1 unless it says otherwise.
    beam_size = payload.get("beam_size", 1 if sampled else settings.beam_size)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or not 1 <= beam_size <= settings.max_beam_size:
        number = isinstance(beam_size, (int, float)) and not isinstance(beam_size, bool)
        raise RequestError(
            400, f"beam_size must be an integer in [1, {settings.max_beam_size}] (--max-beam-size; 1 is greedy), "
            f"received {beam_size if number else _json_type(beam_size)}", "bad_request",
        )
    max_extra_length = payload.get("max_extra_length", settings.max_extra_length)
    if not is_integer(max_extra_length) or not 0 <= max_extra_length <= settings.max_extra_length:
        raise RequestError(
            400, f"max_extra_length must be an integer in [0, {settings.max_extra_length}] (--max-extra-length), "
            f"received {_number_or_type(max_extra_length)}", "bad_request",
        )
    num_hypotheses = payload.get("num_hypotheses")
    try:  # checked once, when made: SearchOptions' own one-line messages (they name the field)
        options = SearchOptions(
            beam_size, float(settings.length_penalty), int(max_extra_length), settings.patience,
            num_hypotheses, **sampling,
        )
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None
    if num_hypotheses is not None and num_hypotheses > settings.max_beam_size:  # samples: rows per text
        raise RequestError(
            400, f"num_hypotheses must be at most {settings.max_beam_size} (--max-beam-size), received {num_hypotheses}",
            "bad_request",
        )
    if not sampled:
        # Without sampling the other sampling fields change nothing: left at their defaults, the request batches
        # with the others of its options.
        options = dataclasses.replace(options, **SAMPLING_DEFAULTS)
    return texts, options, target_prefix


def _number_or_type(value):
    """A received value as a message quotes it: a number itself, anything else its JSON type."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _json_type(value)


def timeout_option(payload, settings):
    """The request's `timeout_ms` (None when not given), checked to be at most `request_timeout` (400)."""
    value = payload.get("timeout_ms")
    if value is None:
        return None
    cap = int(settings.request_timeout * 1000)
    if not is_integer(value) or not 1 <= value <= cap:
        raise RequestError(
            400, f"timeout_ms must be an integer in [1, {cap}] (--request-timeout), received {_number_or_type(value)}",
            "bad_request",
        )
    return value


def stream_option(payload):
    """The request's `stream` (False when not given): true or false, else 400."""
    value = payload.get("stream", False)
    if not isinstance(value, bool):
        raise RequestError(
            400, f"stream must be true or false, received {_json_type(value) if not isinstance(value, str) else repr(value)}",
            "bad_request",
        )
    return value


def split_sentences_option(payload, options, target_prefix):
    """The request's `split_sentences` (False, True or a language code), checked against the other fields (400)."""
    value = payload.get("split_sentences", False)
    if value is False:
        return False
    if not (value is True or (isinstance(value, str) and value.strip())):
        raise RequestError(
            400, f"split_sentences must be true, false or a language code such as \"de\", received "
            f"{_json_type(value) if not isinstance(value, str) else repr(value)}", "bad_request",
        )
    for field, given in (("target_prefix", target_prefix is not None), ("num_hypotheses", options.num_hypotheses)):
        if given:
            raise RequestError(400, f"split_sentences cannot be used with {field}", "bad_request")
    return value


def format_option(payload, options, target_prefix, streamed):
    """The request's `format` ("text" or "html"; "text" when not given), checked against the other fields (400)."""
    from keras_transformer.documents.markup import FORMATS

    value = payload.get("format", "text")
    if value not in FORMATS:
        raise RequestError(400, f'format must be "text" or "html", received '
                           f"{_json_type(value) if not isinstance(value, str) else repr(value)}", "bad_request")
    if value == "html":  # an HTML text is several inputs (one per block), translated once each
        for field, given in (("target_prefix", target_prefix is not None), ("num_hypotheses", options.num_hypotheses),
                             ("stream", streamed)):
            if given:
                raise RequestError(400, f'format "html" cannot be used with {field}', "bad_request")
    return value


def html_pages(texts):
    """`markup.Page` of each HTML text (its units to translate), or `RequestError` (400) in the parser's one line."""
    from keras_transformer.documents import markup

    try:
        return [markup.Page(text, f"text[{i}]") for i, text in enumerate(texts)]
    except ValueError as error:
        raise RequestError(400, str(error), "bad_request") from None


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked `/v1/translate` request: its texts, search options and the fields of the request itself."""

    texts: list
    options: SearchOptions
    target_prefix: list | None = None
    timeout_ms: int | None = None
    stream: bool = False
    languages: tuple | None = None
    split_sentences: bool | str = False
    format: str = "text"
    return_alignment: bool = False


def read_request(payload, settings, engine_name=None, features=FEATURES):
    """A `Request` from a payload (`parse_payload`), each field checked (`RequestError`, 400 naming it)."""
    texts, options, target_prefix = request_from_payload(payload, settings, engine_name, features)
    stream = stream_option(payload)
    asked = Request(
        texts, options, target_prefix, timeout_ms=timeout_option(payload, settings), stream=stream,
        languages=languages_option(payload), split_sentences=split_sentences_option(payload, options, target_prefix),
        format=format_option(payload, options, target_prefix, stream),
    )
    return dataclasses.replace(asked, return_alignment=alignment_option(payload, asked))


def alignment_option(payload, asked):
    """The request's `return_alignment` (False when not given): true or false, and not with `stream`,
    `split_sentences` or `"format": "html"` (400)."""
    value = payload.get("return_alignment", False)
    if not isinstance(value, bool):
        raise RequestError(
            400, f"return_alignment must be true or false, received "
            f"{_json_type(value) if not isinstance(value, str) else repr(value)}", "bad_request",
        )
    for field, given in (
        ("stream", asked.stream), ("split_sentences", asked.split_sentences is not False),
        ('"format": "html"', asked.format == "html"),
    ):
        if value and given:
            raise RequestError(400, f"return_alignment cannot be used with {field}", "bad_request")
    return value

def _check_text(text, name, settings):
    if not isinstance(text, str):
        raise RequestError(400, f"{name} must be a string, received {_json_type(text)}", "bad_request")
    if len(text) > settings.max_text_chars:
        raise RequestError(
            400, f"{name} has {len(text)} characters; the limit is {settings.max_text_chars} (--max-text-chars)",
            "text_too_long",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a \ud800 escape
        raise RequestError(400, f"{name} is not valid Unicode (a lone surrogate)", "bad_request") from None


def _target_prefix(payload, texts, single, settings):
    """The request's `target_prefix` as one str or None per text, or None; its form checked (400)."""
    target_prefix = payload.get("target_prefix")
    if target_prefix is None:
        return None
    if single and isinstance(target_prefix, str):
        target_prefix = [target_prefix]
    if not isinstance(target_prefix, list) or len(target_prefix) != len(texts):
        raise RequestError(
            400, f"target_prefix must be an array of one string or null per text ({len(texts)}), received "
            f"{_json_type(target_prefix) if not isinstance(target_prefix, list) else f'{len(target_prefix)} items'}",
            "bad_request",
        )
    for i, prefix in enumerate(target_prefix):
        if prefix is not None:
            _check_text(prefix, f"target_prefix[{i}]", settings)
    return target_prefix if any(target_prefix) else None


def answer_document(results, options, align=False):
    """The JSON answer: `translations`; with `num_hypotheses` each text's `hypotheses` (text, score, log_prob);
    with `align` each translation's `alignments` (and each hypothesis' `alignment`): `alignment_json`."""
    if options.num_hypotheses is None and not align:
        return {"translations": results}
    document = {"translations": [found[0].text if found else "" for found in results]}
    if options.num_hypotheses is not None:
        document["hypotheses"] = [hypotheses_json(found, align) for found in results]
    if align:
        document["alignments"] = [alignment_json(found[0]) if found else [] for found in results]
    return document


def hypotheses_json(found, align=False):
    """A text's hypotheses as JSON objects (text, score, log_prob; with `align`, alignment)."""
    hypotheses = [{"text": h.text, "score": float(h.score), "log_prob": float(h.log_prob)} for h in found]
    if align:
        for hypothesis, json_object in zip(found, hypotheses):
            json_object["alignment"] = alignment_json(hypothesis)
    return hypotheses


def alignment_json(hypothesis):
    """A hypothesis' word alignment as one `{"source": [start, end], "target": [start, end]}` per aligned word pair.

    The spans are character offsets (end excluded) into the request's text and the translation, in target-word
    order, then source order (`Hypothesis.word_alignment`); a target word aligned to no source word has no pair.
    """
    return [{"source": list(source), "target": list(word.target)}
            for word in hypothesis.word_alignment or () for source in word.source]


def engine_error(error):
    return RequestError(500, f"the translation failed: {type(error).__name__}: {error}", "engine")


def request_id(scope):
    """`(id, refusal)`: the client's `X-Request-Id`, or a made-up one; refusal: None, or why the client's was refused.

    A client's id goes into log lines as it is: one header of 1 to
    `MAX_REQUEST_ID_CHARS` visible ASCII characters. Another is replaced by
    a made-up one (32 hex digits), and the refusal says why in one line.
    """
    header = REQUEST_ID_HEADER.encode()
    given = [value.decode("latin-1") for name, value in scope.get("headers", ()) if name.lower() == header]
    if len(given) == 1 and _REQUEST_ID.fullmatch(given[0]):
        return given[0], None
    made_up = uuid.uuid4().hex
    if not given:
        return made_up, None
    if len(given) > 1:
        why = f"{len(given)} X-Request-Id headers"
    elif len(given[0]) > MAX_REQUEST_ID_CHARS:
        why = f"{len(given[0])} characters"
    else:
        why = "a space or a character outside ASCII" if given[0] else "an empty value"
    limit = f"one header of 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters"
    return made_up, f"X-Request-Id must be {limit}, received {why}"
