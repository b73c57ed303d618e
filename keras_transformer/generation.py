"""Greedy and beam search: the public names of `keras_transformer.search`.

The search lives in the `keras_transformer/search/` package (the decoding
protocol and `generate` in `search/api.py`); this module keeps the names that
users, the exporters, tests and benchmarks import from here.

The settings `TF_JIT_COMPILE`, `SEGMENTS` and `TORCH_COMPILE_BACKEND` have one home,
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
    generate_hypotheses,
    generate_in_graph,
    hypotheses_graph,
    search_graph,
    start_graph,
    update_graph,
)
from keras_transformer.decoding import Hypotheses  # noqa: F401
from keras_transformer.search.beam import gather_beams, reorder_cache, tile_cache  # noqa: F401
from keras_transformer.search.common import NEG_INF  # noqa: F401
from keras_transformer.search.lengths import length_penalty_factor  # noqa: F401
from keras_transformer.search.log_probs import FORCED_END_LOG_PROB, token_log_probs  # noqa: F401
from keras_transformer.search.loop import (  # noqa: F401
    SEARCH_STATE_KEYS,
    initial_search_state,
    search_result,
    search_step,
    search_tokens,
)


def _setting(name):
    """A property of this module that reads and sets `keras_transformer.search.compiled.<name>`."""

    def set_value(module, value):
        setattr(_compiled, name, value)

    return property(lambda module: getattr(_compiled, name), set_value, doc=f"`search.compiled.{name}`")


class _GenerationModule(types.ModuleType):
    """This module, with the compile settings forwarded to `keras_transformer.search.compiled`.

    Data descriptors, so that `monkeypatch.setattr` saves and restores them
    through the property as well.
    """

    TF_JIT_COMPILE = _setting("TF_JIT_COMPILE")
    SEGMENTS = _setting("SEGMENTS")
    TORCH_COMPILE_BACKEND = _setting("TORCH_COMPILE_BACKEND")


sys.modules[__name__].__class__ = _GenerationModule
