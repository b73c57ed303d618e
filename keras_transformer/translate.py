"""`python -m keras_transformer.translate`: translate text with a preset directory or a pretrained checkpoint.

Reads one sentence per line from stdin (or `--input`), writes one
translation per line to stdout (or `--output`); progress goes to stderr.

```
echo "A sentence." | python -m keras_transformer.translate --preset runs/small
python -m keras_transformer.translate --preset runs/small --input test.en --output test.de --beam-size 4
echo "A sentence." | python -m keras_transformer.translate --preset opus_mt_en_de    # downloaded once
```
"""

import argparse
import os
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

# `read_lines` is re-exported: export/runtime.py imports it from here.
from keras_transformer.textio import read_lines  # noqa: E402
from keras_transformer.utils import atomic_path  # noqa: E402

__all__ = ["build_parser", "main", "read_lines", "write_lines"]


def write_lines(path, lines, overwrite=False):
    """Writes `lines` to `path` atomically (a temporary file, then `os.replace`).

    Args:
        path: output file.
        lines: iterable of str, one per line.
        overwrite: bool, replace an existing file.

    Raises:
        FileExistsError: when `path` exists and `overwrite` is False.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")
    with atomic_path(path, suffix=".tmp") as temporary, open(temporary, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.translate",
        description="Translate one sentence per line with a preset directory or a pretrained checkpoint "
                    "(model + tokenizer).",
    )
    parser.add_argument("--preset", required=True, help=cli.PRESET_HELP)
    parser.add_argument("--input", default=None, help="input file (plain or .gz); default stdin")
    parser.add_argument("--output", default=None, help="output file; default stdout")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--beam-size", type=int, default=4, help="beam size; 1 is greedy (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per search (default 32)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha (default 0.6)")
    parser.add_argument(
        "--max-extra-length", type=int, default=50, help="output tokens beyond the source length (default 50)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cli.add_verbose_argument(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    # Checked before loading the model, so a refusal is immediate.
    if args.output is not None and os.path.exists(args.output) and not args.overwrite:
        parser.error(f"{args.output} already exists; pass --overwrite to replace it")
    cli.setup_logging(args.verbose)

    from keras_transformer.translator import Translator

    try:
        sources = read_lines(args.input)
        translator = Translator.from_preset(args.preset)
        translations = translator.translate(
            sources,
            beam_size=args.beam_size,
            batch_size=args.batch_size,
            length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length,
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as error:  # Bad input or preset: one line, no traceback.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.output is None:
        sys.stdout.write("".join(line + "\n" for line in translations))
        sys.stdout.flush()
    else:
        write_lines(args.output, translations, overwrite=args.overwrite)
        print(f"Wrote {len(translations)} lines to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
