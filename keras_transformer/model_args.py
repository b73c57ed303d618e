"""Moved to keras_transformer.modeling.args; this path re-exports it."""

from keras_transformer.modeling.args import *  # noqa: F401,F403
