"""`python -m keras_transformer.evaluate`: sacreBLEU and chrF of a preset directory or a pretrained checkpoint.

```
python -m keras_transformer.evaluate --preset runs/small                  # the bundled test split
python -m keras_transformer.evaluate --preset runs/base --src newstest2014.en --ref newstest2014.de --json
python -m keras_transformer.evaluate --preset hf://Helsinki-NLP/opus-mt-en-de --limit 100
python -m keras_transformer.evaluate --preset runs/small --quantize int8 --limit 200    # Keras' int8
```

Scores are detokenized sacreBLEU (13a tokenization, the library's default)
and chrF2, printed with sacreBLEU's signature so that they can be compared
and reproduced. The paper reports BLEU on tokenized text (multi-bleu), which
is not the same number.
"""

import argparse
import json
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

from keras_transformer.textio import read_lines  # noqa: E402


def evaluate(
    translator,
    sources,
    references,
    beam_size=4,
    batch_size=32,
    length_penalty=0.6,
    max_extra_length=50,
    progress=False,
):
    """Translates `sources` and scores them against `references`.

    Args:
        translator: a `Translator` (or any object with its `translate`).
        sources: list of str.
        references: list of str, one reference per source.
        beam_size, batch_size, length_penalty, max_extra_length, progress:
            passed to `translator.translate`.

    Returns:
        dict with `bleu` and `chrf` (floats), `bleu_signature`,
        `chrf_signature`, `bleu_details` and `chrf_details` (the lines the
        sacrebleu command prints, with n-gram precisions, brevity penalty
        and lengths for BLEU), `sentences`,
        `beam_size`, `length_penalty` and `hypotheses` (list of str).

    Example:
    >>> result = evaluate(Translator.from_preset("runs/small"), ["A cat."], ["Eine Katze."])
    >>> sorted(result)[:3]
    ['beam_size', 'bleu', 'bleu_details']
    """
    from sacrebleu.metrics import BLEU, CHRF

    sources, references = list(sources), list(references)
    if len(sources) != len(references):
        raise ValueError(
            f"Received {len(sources)} sources but {len(references)} references; "
            "they must be aligned line by line"
        )
    if not sources:
        raise ValueError("Received no sentences to evaluate")
    hypotheses = translator.translate(
        sources,
        beam_size=beam_size,
        batch_size=batch_size,
        length_penalty=length_penalty,
        max_extra_length=max_extra_length,
        progress=progress,
    )
    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    bleu_signature, chrf_signature = str(bleu.get_signature()), str(chrf.get_signature())
    return {
        "bleu": float(bleu_score.score),
        "chrf": float(chrf_score.score),
        # As the sacrebleu command prints them: "BLEU|nrefs:1|...|version:2.6.0".
        "bleu_signature": f"{bleu_score.name}|{bleu_signature}",
        "chrf_signature": f"{chrf_score.name}|{chrf_signature}",
        "bleu_details": bleu_score.format(signature=bleu_signature),
        "chrf_details": chrf_score.format(signature=chrf_signature),
        "sentences": len(sources),
        "beam_size": beam_size,
        "length_penalty": length_penalty,
        "hypotheses": hypotheses,
    }


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.evaluate",
        description="sacreBLEU and chrF of a preset directory or a pretrained checkpoint on parallel text "
                    "(default: the bundled test split).",
    )
    parser.add_argument("--preset", required=True, help=cli.PRESET_HELP)
    parser.add_argument("--source-language", default=None,
                        help="a multilingual model's (NLLB-200's) source language code, e.g. eng_Latn")
    parser.add_argument("--target-language", default=None,
                        help="a multilingual model's (NLLB-200's) target language code, e.g. deu_Latn")
    parser.add_argument("--src", default=None, help="source file, one sentence per line (plain or .gz)")
    parser.add_argument("--ref", default=None, help="reference file aligned with --src")
    parser.add_argument("--beam-size", type=int, default=4, help="beam size; 1 is greedy (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per search (default 32)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha (default 0.6)")
    parser.add_argument("--max-extra-length", type=int, default=50, help="default 50")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N sentences only")
    parser.add_argument("--json", action="store_true", help="print one JSON object (without the hypotheses)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cli.add_quantize_argument(parser)
    cli.add_verbose_argument(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.src is None) != (args.ref is None):
        parser.error("pass both --src and --ref, or neither (the bundled test split)")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit={args.limit} must be a positive integer")
    cli.setup_logging(args.verbose)

    from keras_transformer.translator import Translator

    try:
        if args.src is None:
            from keras_transformer.datasets import bundled_paths, load_bundled, portable_name

            sources, references = load_bundled("test")
            source_name, reference_name = (portable_name(p) for p in bundled_paths("test"))
        else:
            sources, references = read_lines(args.src), read_lines(args.ref)
            source_name, reference_name = args.src, args.ref
        if args.limit is not None:
            sources, references = sources[: args.limit], references[: args.limit]
        translator = Translator.from_preset(args.preset, quantize=args.quantize).with_languages(
            args.source_language, args.target_language)
        result = evaluate(
            translator,
            sources,
            references,
            beam_size=args.beam_size,
            batch_size=args.batch_size,
            length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length,
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as error:  # Bad input or preset: one line, no traceback.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    result.pop("hypotheses")
    result.update(preset=args.preset, quantize=args.quantize, src=source_name, ref=reference_name)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(result["bleu_details"])
        print(result["chrf_details"])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
