"""`python -m keras_transformer.train`: train a Transformer and write a preset directory.

With no data arguments it trains on the bundled LibreOffice English-German
corpus. Run it again with the same --output to resume after an interruption.

```
python -m keras_transformer.train --preset small --output runs/small                 # from scratch
python -m keras_transformer.train --init-from opus_mt_en_de --output runs/finetuned \
    --train-src train.en --train-tgt train.de --steps 2000 --learning-rate-scale 0.1   # fine-tune
python -m keras_transformer.train --init-from opus_mt_en_de --output runs/lora \
    --train-src train.en --train-tgt train.de --steps 2000 --lora-rank 8               # LoRA adapters only
```
"""

import argparse
import json
import logging
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

from keras_transformer.lora import LORA_TARGET_NAMES, LORA_TARGETS  # noqa: E402
from keras_transformer.training import (  # noqa: E402
    DEFAULT_VALIDATION_BLEU_SENTENCES, MIXED_PRECISIONS, STRATEGIES, UserInputError, run_training,
)
from keras_transformer.utils import (  # noqa: E402
    auto_or_bool, non_negative_int, positive_float, positive_int, unit_interval,
)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.train", description=__doc__.splitlines()[0]
    )
    start = parser.add_argument_group("what is trained (one of)")
    start.add_argument("--preset", help="architecture preset or preset directory, trained with a new vocabulary "
                                        "(default: small)")
    start.add_argument("--init-from", metavar="MODEL",
                       help="a trained model to fine-tune with its own tokenizer: a preset directory, a Hugging Face "
                            "Marian, NLLB-200 or FSMT checkpoint directory, hf://org/name or a pretrained preset (e.g. "
                            "opus_mt_en_de)")
    start.add_argument("--source-language", metavar="CODE",
                       help="with --init-from a multilingual checkpoint (NLLB-200): the data's source language, "
                            "e.g. eng_Latn")
    start.add_argument("--target-language", metavar="CODE",
                       help="with --init-from a multilingual checkpoint (NLLB-200): the data's target language, "
                            "e.g. deu_Latn")
    lora = parser.add_argument_group("LoRA (with --init-from)")
    lora.add_argument("--lora-rank", type=positive_int, metavar="R",
                      help="train only rank-R LoRA adapters, every other weight frozen; the preset is written merged")
    lora.add_argument("--lora-targets", nargs="+", choices=LORA_TARGET_NAMES, metavar="NAME",
                      help="what the adapters adapt: attention (default), feedforward, or single projections "
                           f"({', '.join(name for name in LORA_TARGET_NAMES if name not in LORA_TARGETS)})")
    parser.add_argument("--output", required=True, help="preset directory to write (resumed if interrupted)")
    parser.add_argument("--train-src", help="training source file (plain or .gz, one sentence per line)")
    parser.add_argument("--train-tgt", help="training target file, line-aligned with --train-src")
    parser.add_argument("--valid-src", help="validation source file")
    parser.add_argument("--valid-tgt", help="validation target file")
    parser.add_argument("--vocabulary-size", type=positive_int, help="shared subword vocabulary (default: the preset's)")
    parser.add_argument("--tokenizer-max-sentences", type=positive_int,
                        help="train the vocabulary on a sample of this many sentences (default: all)")
    parser.add_argument("--tokens-per-batch", type=positive_int, default=25000, help="token budget per batch side (paper: 25000)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, help="training length in optimizer updates")
    length.add_argument("--epochs", type=positive_int, help="passes over the training data (default 10)")
    parser.add_argument("--max-length", type=positive_int, default=128, help="drop pairs longer than this many tokens")
    parser.add_argument("--warmup-steps", type=positive_int, default=4000, help="learning-rate warmup in updates (paper: 4000)")
    parser.add_argument("--learning-rate-scale", type=positive_float, default=1.0, help="multiplies the paper's learning rate")
    parser.add_argument("--label-smoothing", type=unit_interval, default=0.1)
    parser.add_argument("--dropout", type=unit_interval, help="P_drop (default: the preset's or checkpoint's)")
    parser.add_argument("--gradient-accumulation-steps", type=positive_int, metavar="K",
                        help="one update per K batches, from their mean gradient (an update sees K x --tokens-per-batch)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=500,
                        help="updates between resume points and checkpoints (default: 500)")
    parser.add_argument("--checkpoint-every-minutes", type=positive_float, metavar="M",
                        help="write the averaged checkpoints every M minutes of training instead (paper: 10)")
    parser.add_argument("--keep-checkpoints", type=positive_int, default=5)
    parser.add_argument("--average-last", type=positive_int,
                        help="average the last K checkpoints (default: the preset's; paper: 5 base, 20 big)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto")
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISIONS,
                        help="auto: mixed_bfloat16 where the CPU (AVX512-BF16 or AMX; on JAX, AMX) or GPU "
                             "computes it natively, else float32 (default: float32)")
    parser.add_argument("--jit-compile", type=auto_or_bool, default="auto", metavar="{auto,true,false}",
                        help="XLA-compile the training step (default auto: off under MirroredStrategy and for "
                             "TensorFlow on a CPU, else Keras' choice)")
    validation = parser.add_mutually_exclusive_group()
    validation.add_argument("--validation-bleu-sentences", type=positive_int, metavar="N",
                            default=DEFAULT_VALIDATION_BLEU_SENTENCES,
                            help="the validation BLEU at the end scores the first N validation sentences "
                                 f"(default: {DEFAULT_VALIDATION_BLEU_SENTENCES}, all of the bundled corpus's)")
    validation.add_argument("--no-validation-bleu", dest="validation_bleu", action="store_false",
                            help="skip the validation BLEU at the end (beam search: minutes for a large model on a "
                                 "CPU); the validation loss is still computed")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace a run or preset at --output once the new one is complete")
    cli.add_verbose_argument(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.setup_logging(args.verbose, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        metadata = _train(args)
    except UserInputError as error:
        # Raised before anything was written: one line, like an argparse error.
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({k: v for k, v in metadata.items() if k != "data"}, indent=2))


def _train(args):
    return run_training(
        args.output,
        preset=args.preset,
        init_from=args.init_from,
        source_language=args.source_language,
        target_language=args.target_language,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_targets,
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
        checkpoint_every_minutes=args.checkpoint_every_minutes,
        keep_checkpoints=args.keep_checkpoints,
        average_last=args.average_last,
        strategy=args.strategy,
        mixed_precision=args.mixed_precision,
        jit_compile=args.jit_compile,
        validation_bleu=args.validation_bleu,
        validation_bleu_sentences=args.validation_bleu_sentences,
        seed=args.seed,
        overwrite=args.overwrite,
        model_overrides={"dropout": args.dropout} if args.dropout is not None else None,
    )


if __name__ == "__main__":
    main()
