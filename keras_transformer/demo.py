"""`python -m keras_transformer.demo`: build the paper's models and check cached decoding.

A smoke run for a fresh install, until training, translation and export are
in the Quick start.
"""

import argparse
import logging

import numpy as np

import keras_transformer as kt


def run():
    """Builds every architecture preset (not the pretrained ones, which download), then checks cached against full decoding on `tiny`.

    Returns:
        dict: preset name -> parameter count, and the largest logit
        difference between cached and full decoding.
    """
    import keras

    from keras_transformer.presets import PRESETS
    from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID

    counts = {name: kt.TransformerModel.from_preset(name).count_params() for name in PRESETS}
    model = kt.TransformerModel.from_preset("tiny", dropout=0.0)
    rng = np.random.default_rng(0)
    src = rng.integers(FIRST_ORDINARY_ID, model.vocabulary_size, size=(2, 9)).astype("int32")
    tgt = rng.integers(FIRST_ORDINARY_ID, model.vocabulary_size, size=(2, 6)).astype("int32")
    full = keras.ops.convert_to_numpy(model({"encoder_token_ids": src, "decoder_token_ids": tgt}))
    cache = model.init_cache(model.encode(src), src, max_length=tgt.shape[1])
    difference = 0.0
    for t in range(tgt.shape[1]):
        step, cache = model.decode_step(tgt[:, t], t, cache)
        difference = max(difference, float(np.abs(keras.ops.convert_to_numpy(step) - full[:, t]).max()))
    return counts, difference


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    import keras

    counts, difference = run()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    for name, count in counts.items():
        print(f"  {name:10s} {count / 1e6:8.1f}M parameters")
    print(f"cached vs full decoding on 'tiny': largest logit difference {difference:.2e}")
    if difference > 1e-4:
        raise SystemExit("cached decoding disagrees with full decoding")


if __name__ == "__main__":
    main()
