"""Moved to keras_transformer.modeling.cache; this path re-exports it."""

from keras_transformer.modeling.cache import *  # noqa: F401,F403
from keras_transformer.modeling.cache import _OUTPUT_KERNEL  # noqa: F401
