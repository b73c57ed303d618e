"""Moved to keras_transformer.tokenizers.sentencepiece; this path re-exports it."""

from keras_transformer.tokenizers.sentencepiece import *  # noqa: F401,F403
from keras_transformer.tokenizers.sentencepiece import _sentences  # noqa: F401
