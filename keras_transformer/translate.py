"""`python -m keras_transformer.translate`: translate text with a preset directory or a pretrained checkpoint.

Reads one sentence per line from stdin (or `--src`), writes one translation
per line to stdout (or `--output`), streaming: `--window` lines at a time
are sorted by length into batches (`--batch-size` sentences or
`--max-batch-tokens` source tokens), so a file of any size translates in
bounded memory (`Translator.translate_file`). `--output` is written to a
temporary beside it and renamed when complete. A progress bar goes to stderr
when it is a terminal.

```
echo "A sentence." | python -m keras_transformer.translate --preset runs/small
python -m keras_transformer.translate --preset runs/small --src test.en --output test.de --max-batch-tokens 4096
echo "A sentence." | python -m keras_transformer.translate --preset opus_mt_en_de    # downloaded once
echo "A sentence." | python -m keras_transformer.translate --preset nllb-dir --source-language eng_Latn --target-language fra_Latn
echo "A sentence." | python -m keras_transformer.translate --preset runs/small --quantize int8   # Keras' int8
python -m keras_transformer.translate --preset runs/small --format html --src page.html --output page.de.html
```
"""

import argparse
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

# `read_lines` and `write_lines` are re-exported (their home is keras_transformer.textio).
from keras_transformer.textio import (  # noqa: E402
    check_output_path,
    check_text_file,
    iter_lines,
    read_lines,
    split_lines,
    write_lines,
)
from keras_transformer.documents.markup import FORMATS  # noqa: E402
from keras_transformer.search.options import DEFAULTS, SearchOptions, resolve  # noqa: E402
from keras_transformer.translator import DEFAULT_WINDOW, Translator  # noqa: E402  (no framework: NumPy)
from keras_transformer.utils import positive_int  # noqa: E402

__all__ = [
    "add_file_arguments", "add_language_arguments", "add_search_arguments", "build_parser", "check_file_arguments", "main", "read_lines",
    "search_options", "translate_lines", "write_lines",
]


def add_search_arguments(parser):
    """`--beam-size`, `--length-penalty`, `--max-extra-length`, shared with `python -m export.runtime`.

    The sampling options and `--patience` are `add_file_arguments`'; `search_options` makes the
    `SearchOptions` of them all.
    """
    parser.add_argument("--beam-size", type=int, default=4, help="beam size; 1 is greedy (default 4)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha (default 0.6)")
    parser.add_argument(
        "--max-extra-length", type=int, default=50, help="output tokens beyond the source length (default 50)"
    )
    return parser


def search_options(args, **search):
    """The `SearchOptions` of a command's search arguments (those `args` has); `search` keywords replace them.

    Raises:
        ValueError: a bad value, in `SearchOptions`' one line (the commands print it and exit with 2).
    """
    values = {name: getattr(args, name) for name in DEFAULTS if hasattr(args, name)}
    return SearchOptions(**{**values, **search})


def add_file_arguments(parser):
    """The input, output and batching options shared with `python -m export.runtime`."""
    parser.add_argument("--src", "--input", dest="src", default=None,
                        help="input file, one sentence per line (plain or .gz); default stdin")
    parser.add_argument("--output", default=None, help="output file (its directory must exist); default stdout")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="sentences per search (default 32, or no limit with --max-batch-tokens)")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=None,
                        help="padded source tokens per search (default: no limit)")
    parser.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW,
                        help=f"lines sorted by length together (default {DEFAULT_WINDOW}; memory grows with it)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (by default one is drawn on stderr when it is a terminal)")
    parser.add_argument("--sampling-topk", type=int, default=1,
                        help="sample each token from the K most probable (0: all; default 1: no sampling; "
                             "with --beam-size 1)")
    parser.add_argument("--sampling-topp", type=float, default=1.0,
                        help="when sampling, keep the most probable tokens up to this probability (default 1)")
    parser.add_argument("--sampling-temperature", type=float, default=1.0,
                        help="when sampling, divide the log-probabilities by this (> 0, default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument(
        "--split-sentences", nargs="?", const=True, default=False, metavar="LANG",
        help="each line may hold several sentences: translate them one by one and write the line back with its "
             "spacing (sentencex's rules; LANG, e.g. de, for that language's abbreviations; default English)",
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="text",
        help="text (default): one text per line; html: the whole input is one HTML page (or fragment), written "
             "back with its markup and the text of each block translated (keras_transformer.documents.markup)",
    )
    parser.add_argument(
        "--patience", type=float, default=None,
        help="beam search: stop a sentence once round(beam size x PATIENCE) hypotheses ended, as CTranslate2 "
             "(1 is its default); without it, the exact search: stop when no live beam can win",
    )
    return parser


def check_file_arguments(args):
    """Refuses a missing or binary --src and an --output that must not be written, before loading a model."""
    check_text_file(args.src, "--src")
    if args.output is not None:
        check_output_path(args.output, "--output", overwrite=args.overwrite, source=args.src, source_name="--src",
                          overwrite_name="--overwrite")


def show_progress(args):
    """Whether the commands draw a progress bar: on stderr when it is a terminal, unless `--no-progress`.

    A bar redrawn into a log file or a pipe is noise, and tqdm takes a
    noticeable part of a one-sentence start-up (`python -m export.runtime`).
    """
    return not args.no_progress and sys.stderr.isatty()


def translate_lines(translator, args, options=None, **search):
    """Translates `args.src` (or stdin) into `args.output` (or stdout); returns the number of lines.

    `options`: the `SearchOptions`; by default `search_options(args, **search)`.
    """
    options = search_options(args, **search) if options is None else resolve(options, **search)
    if getattr(args, "format", "text") == "html":  # one document: read whole, translated in one call
        page = "\n".join(iter_lines(args.src))
        batching = dict(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
                        progress=show_progress(args), split_sentences=getattr(args, "split_sentences", False))
        lines = split_lines(translator.translate([page], options=options, format="html", **batching)[0])
        if args.output is not None:
            return write_lines(args.output, lines, overwrite=args.overwrite)
        sys.stdout.writelines(line + "\n" for line in lines)
        sys.stdout.flush()
        return len(lines)
    batching = dict(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, window=args.window,
                    progress=show_progress(args), options=options,
                    split_sentences=getattr(args, "split_sentences", False))
    if args.output is not None:
        return translator.translate_file(args.src or "-", args.output, overwrite=args.overwrite, **batching)
    count = 0
    for count, line in enumerate(translator.translate_iterable(iter_lines(args.src), **batching), start=1):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return count


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.translate",
        description="Translate one sentence per line with a preset directory or a pretrained checkpoint "
                    "(model + tokenizer).",
    )
    parser.add_argument("--preset", required=True, help=cli.PRESET_HELP)
    add_language_arguments(parser)
    add_search_arguments(parser)
    add_file_arguments(parser)
    cli.add_quantize_argument(parser)
    cli.add_verbose_argument(parser)
    return parser


def add_language_arguments(parser):
    """`--source-language`, `--target-language`: a multilingual model's (NLLB-200's) codes."""
    parser.add_argument("--source-language", default=None,
                        help="a multilingual model's (NLLB-200's) source language code, e.g. eng_Latn")
    parser.add_argument("--target-language", default=None,
                        help="a multilingual model's (NLLB-200's) target language code, e.g. fra_Latn")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.setup_logging(args.verbose)
    try:
        # Before loading the model, so that a refusal is immediate.
        check_file_arguments(args)
        options = search_options(args)
        translator = Translator.from_preset(args.preset, quantize=args.quantize).with_languages(
            args.source_language, args.target_language)
        count = translate_lines(translator, args, options=options)
    except (ValueError, OSError) as error:  # Bad input or preset: one line, no traceback.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.output is not None:
        print(f"Wrote {count} lines to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
