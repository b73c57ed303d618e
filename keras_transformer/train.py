"""`python -m keras_transformer.train`: train a Transformer and write a preset directory.

With no data arguments it trains on the bundled LibreOffice English-German
corpus. Run it again with the same --output to resume after an interruption.
"""

import argparse
import json
import logging

from keras_transformer.training import STRATEGIES, run_training


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="small", help="architecture preset or preset directory (default: small)")
    parser.add_argument("--output", required=True, help="preset directory to write (resumed if interrupted)")
    parser.add_argument("--train-src", help="training source file (plain or .gz, one sentence per line)")
    parser.add_argument("--train-tgt", help="training target file, line-aligned with --train-src")
    parser.add_argument("--valid-src", help="validation source file")
    parser.add_argument("--valid-tgt", help="validation target file")
    parser.add_argument("--vocabulary-size", type=int, help="shared subword vocabulary (default: the preset's)")
    parser.add_argument("--tokenizer-max-sentences", type=int,
                        help="train the vocabulary on a sample of this many sentences (default: all)")
    parser.add_argument("--tokens-per-batch", type=int, default=25000, help="token budget per batch side (paper: 25000)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="training steps")
    length.add_argument("--epochs", type=int, help="passes over the training data (default 10)")
    parser.add_argument("--max-length", type=int, default=128, help="drop pairs longer than this many tokens")
    parser.add_argument("--warmup-steps", type=int, default=4000, help="learning-rate warmup (paper: 4000)")
    parser.add_argument("--learning-rate-scale", type=float, default=1.0, help="multiplies the paper's learning rate")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--gradient-accumulation-steps", type=int)
    parser.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    parser.add_argument("--keep-checkpoints", type=int, default=5)
    parser.add_argument("--average-last", type=int, default=5, help="average the last K checkpoints (paper: 5 base, 20 big)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto")
    parser.add_argument("--mixed-precision", choices=["mixed_bfloat16", "mixed_float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-resumable --output")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metadata = _run(args)
    except (ValueError, OSError) as error:  # Bad input files, preset or output: one line, no traceback.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps({k: v for k, v in metadata.items() if k != "data"}, indent=2))


def _run(args):
    return run_training(
        args.output,
        preset=args.preset,
        train_src=args.train_src,
        train_tgt=args.train_tgt,
        valid_src=args.valid_src,
        valid_tgt=args.valid_tgt,
        vocabulary_size=args.vocabulary_size,
        tokenizer_max_sentences=args.tokenizer_max_sentences,
        tokens_per_batch=args.tokens_per_batch,
        steps=args.steps,
        epochs=args.epochs,
        max_length=args.max_length,
        warmup_steps=args.warmup_steps,
        learning_rate_scale=args.learning_rate_scale,
        label_smoothing=args.label_smoothing,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        average_last=args.average_last,
        strategy=args.strategy,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
