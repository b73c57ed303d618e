"""Moved to keras_transformer.tokenizers.fsmt; this path re-exports it."""

from keras_transformer.tokenizers.fsmt import *  # noqa: F401,F403
