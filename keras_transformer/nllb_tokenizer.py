"""Moved to keras_transformer.tokenizers.nllb; this path re-exports it."""

from keras_transformer.tokenizers.nllb import *  # noqa: F401,F403
