"""Moved to keras_transformer.modeling.attention; this path re-exports it."""

from keras_transformer.modeling.attention import *  # noqa: F401,F403
