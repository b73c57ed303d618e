"""A translation's languages and target prefixes: a multilingual tokenizer bound to a pair, the forced code.

No framework: the ONNX Runtime server and the CTranslate2 export use these too.
"""

from keras_transformer.decoding import check_prefix_length


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
