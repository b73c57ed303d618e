"""Moved to keras_transformer.documents.alignment; this path re-exports it."""

from keras_transformer.documents.alignment import *  # noqa: F401,F403
