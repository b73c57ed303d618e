"""Greedy and beam search: the public names of `keras_transformer.search`.

The search lives in the `keras_transformer/search/` package (the decoding
protocol and `generate` in `search/api.py`); this module keeps the names that
users, the exporters, tests and benchmarks import from here.

The settings `TF_JIT_COMPILE` and `TORCH_COMPILE_BACKEND` have one home,
`keras_transformer.search.compiled`; reading or setting them here (including
with pytest's `monkeypatch.setattr`) reads or sets them there.
"""

import sys
import types

from keras_transformer.search import compiled as _compiled
from keras_transformer.search.api import (  # noqa: F401
    PROTOCOL_ATTRIBUTES,
    check_protocol,
    generate,
    generate_in_graph,
    search_graph,
)
from keras_transformer.search.beam import gather_beams, reorder_cache, tile_cache  # noqa: F401
from keras_transformer.search.common import NEG_INF  # noqa: F401
from keras_transformer.search.lengths import FORCED_END_LOG_PROB, length_penalty_factor  # noqa: F401
from keras_transformer.search.loop import (  # noqa: F401
    SEARCH_STATE_KEYS,
    initial_search_state,
    search_result,
    search_step,
    search_tokens,
)

_SETTINGS = ("TF_JIT_COMPILE", "TORCH_COMPILE_BACKEND")


class _GenerationModule(types.ModuleType):
    """Forwards the compile settings to `keras_transformer.search.compiled`."""

    def __getattr__(self, name):
        if name in _SETTINGS:
            return getattr(_compiled, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in _SETTINGS:
            setattr(_compiled, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in _SETTINGS:
            raise AttributeError(f"{name} is a setting of keras_transformer.search.compiled; set it, do not delete it")
        super().__delattr__(name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_SETTINGS))


sys.modules[__name__].__class__ = _GenerationModule
