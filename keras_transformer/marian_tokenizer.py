"""Moved to keras_transformer.tokenizers.marian; this path re-exports it."""

from keras_transformer.tokenizers.marian import *  # noqa: F401,F403
