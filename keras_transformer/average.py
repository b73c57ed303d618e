"""`python -m keras_transformer.average`: average Keras weight files.

(Not named `average_checkpoints`: importing a submodule of that name would
replace the function `keras_transformer.average_checkpoints` with the module.)

The paper averages the last 5 (base) or 20 (big) checkpoints (section 6.1).
The average holds the model's weights only: an optimizer state in the inputs
(a resume point, or a checkpoint of a run trained before checkpoints held the
model's weights only) is left out.
"""

import argparse
import os

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

from keras_transformer.training import average_checkpoints, list_checkpoints  # noqa: E402
from keras_transformer.utils import positive_int  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_transformer.average", description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="weight files, or one directory of ckpt-*.weights.h5")
    parser.add_argument("--last", type=positive_int, help="with a directory: average only the last K checkpoints")
    parser.add_argument("--output", required=True, help="averaged .weights.h5 to write")
    parser.add_argument("--overwrite", action="store_true")
    cli.add_verbose_argument(parser)
    args = parser.parse_args(argv)
    cli.setup_logging(args.verbose)
    paths = args.inputs
    if len(paths) == 1 and os.path.isdir(paths[0]):
        paths = list_checkpoints(paths[0])
        if not paths:
            parser.error(f"no ckpt-*.weights.h5 files in {args.inputs[0]}")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        parser.error(f"no such checkpoint file: {missing[0]}")
    if args.last:
        paths = paths[-args.last:]
    if os.path.exists(args.output) and not args.overwrite:
        parser.error(f"{args.output} exists; pass --overwrite to replace it")
    try:
        average_checkpoints(paths, args.output)
    except (ValueError, OSError) as error:  # A missing or non-HDF5 file, or different models.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"averaged {len(paths)} checkpoints into {args.output}")


if __name__ == "__main__":
    main()
