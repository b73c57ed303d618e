"""Moved to keras_transformer.documents.markup; this path re-exports it."""

from keras_transformer.documents.markup import *  # noqa: F401,F403
