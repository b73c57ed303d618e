"""Moved to keras_transformer.modeling.adapters; this path re-exports it."""

from keras_transformer.modeling.adapters import *  # noqa: F401,F403
