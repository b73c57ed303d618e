"""Moved to keras_transformer.tokenizers.base; this path re-exports it."""

from keras_transformer.tokenizers.base import *  # noqa: F401,F403
