"""Compiling the search loop, and the caches of what was compiled.

The settings are read at each call, from this module: set them on
`keras_transformer.generation` (which forwards them here) or here.

- TensorFlow and JAX: the search in compiled segments (`segments.py`: done
  rows leave, the cache grows; batches of 8 rows or more) or the whole
  search (`loop.run` with `compiled=True`), under
  `tf.function(jit_compile=TF_JIT_COMPILE)` or `jax.jit`, cached per
  model; and for models that cannot be traced, the search update alone
  (`loop.search_step`), cached per (backend, search, ids) and shared.
- PyTorch (opt-in, `TORCH_COMPILE_BACKEND`): one step of the search captured
  with `torch.export` and compiled, cached per model and shape.
"""

import contextlib
import logging
import weakref

import keras

from keras_transformer.search import loop, segments
from keras_transformer.search.common import ModelConstants, dim

# The logger of the public module, as before the search became a package.
logger = logging.getLogger("keras_transformer.generation")

# XLA for the compiled search on TensorFlow; on a 2-core CPU it was faster
# than a plain tf.function graph (see benchmarks/README.md).
TF_JIT_COMPILE = True

# TensorFlow and JAX: run the compiled search in segments, between which
# done rows leave the batch and the cache grows (`search/segments.py`), for
# models that can grow their cache; False: the whole search as one compiled
# loop at the batch's full size and longest possible output.
SEGMENTS = True

# PyTorch: None runs the search in an eager loop. Otherwise each step of the
# search (decoder step, search update, beam reordering) is captured as one
# graph with `torch.export`, once per shape, and then run as captured
# ("export": seconds to capture) or compiled with the `torch.compile`
# backend of that name ("inductor": the fast one, about a minute per shape
# on a 2-core CPU). Opt-in for that cost; see benchmarks/README.md.
TORCH_COMPILE_BACKEND = None

# model -> {"search": the whole search compiled, or a PyTorch step per shape}
# for models exposing Keras variables.
_COMPILED = weakref.WeakKeyDictionary()
# (backend, search, vocabulary size and ids) -> the compiled search update of
# the hybrid driver; it reads nothing else of the model, so models share it.
_COMPILED_UPDATES = {}


def _cache_for(model, key, build):
    """`_COMPILED[model][key]`, built once; models that cannot be weakly referenced are not cached."""
    try:
        per_model = _COMPILED.setdefault(model, {})
    except TypeError:
        logger.debug("%s is not weak-referenceable; compiled functions are not cached", type(model).__name__)
        return build()
    if key not in per_model:
        per_model[key] = build()
    return per_model[key]


def forget(model):
    """Drops what was compiled for `model`: after its variables change (`TransformerModel.quantize`).

    The compiled searches hold the model's variable list (JAX) or graphs
    traced over its layers' old code paths (TensorFlow, PyTorch's captured
    steps); the next search compiles again.
    """
    try:
        _COMPILED.pop(model, None)
    except TypeError:  # not weak-referenceable: never cached
        pass


def compiled_search(model):
    """The whole search compiled for `model`, which exposes Keras `variables`.

    `jax.jit` on JAX (the variables are arguments, through
    `keras.StatelessScope`, so they are not baked in as constants and later
    weight updates are seen) and `tf.function(jit_compile=TF_JIT_COMPILE)`
    on TensorFlow (XLA: much faster on CPU than a plain graph, see
    benchmarks/README.md). Returns a driver `(model, encoder_token_ids,
    max_lengths, alpha, beam_size, length, search_name=None, options=None)
    -> hypotheses` (`loop.run`'s).
    """
    model_ref = weakref.ref(model)  # The cache must not keep the model alive.
    build = _build_jax_search if keras.backend.backend() == "jax" else _build_tensorflow_search
    return _cache_for(model, "search", lambda: build(model_ref))


def _build_jax_search(model_ref):
    import jax

    variables = list(model_ref().variables)

    def stateless_search(values, encoder_token_ids, max_lengths, alpha, options, beam_size, length, search_name):
        model = model_ref()
        with keras.StatelessScope(state_mapping=list(zip(variables, values))), _whole_search_scope(model):
            return loop.run(
                model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=True,
                search_name=search_name, options=options, split=True,
            )

    jitted = jax.jit(stateless_search, static_argnames=("beam_size", "length", "search_name"))

    def search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None):
        values = [v.value for v in variables]
        return jitted(
            values, encoder_token_ids, max_lengths, alpha, options or {},
            beam_size=beam_size, length=length, search_name=search_name,
        )

    return search


def _build_tensorflow_search(model_ref):
    import tensorflow as tf

    # autograph=False: the search is keras.ops (no Python control flow on
    # tensors), and autograph's source transformation cost about 10 s on the
    # first trace of each process.
    @tf.function(jit_compile=TF_JIT_COMPILE, autograph=False)
    def traced(encoder_token_ids, max_lengths, alpha, options, beam_size, length, search_name):
        model = model_ref()
        with _whole_search_scope(model):
            return loop.run(
                model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled=True,
                search_name=search_name, options=options, split=True,
            )

    call = _concrete_caller(traced)  # traced once per (batch, source bucket, beam size, L) by design

    def search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None):
        return call(encoder_token_ids, max_lengths, alpha, options or {}, beam_size, length, search_name)

    return search


def _whole_search_scope(model):
    """The model's `transposed_output_kernel` scope, where it has one (optional in the decoding protocol).

    The whole compiled search serves the batches segments do not (`segments.pays`:
    fewer than 8 sources), a few rows per step, where the transposed copy
    pays; at 32 rows and more it did not (benchmarks/README.md), so the
    segments keep the embedding matrix as it is.
    """
    scope = getattr(model, "transposed_output_kernel", None)
    return scope() if callable(scope) else contextlib.nullcontext()


def _concrete_caller(traced):
    """Calls the `tf.function` `traced` through the concrete function of its arguments' shapes.

    Called directly: calling `traced` itself, TensorFlow would count each
    new shape as a retrace and warn "N out of the last N calls ...
    triggered tf.function retracing" from the fifth on.
    """
    return lambda *args: traced.get_concrete_function(*args)(*args)


def segmented_search(model):
    """The search in compiled segments for `model` (`search/segments.py`): done rows leave, the cache grows.

    As `compiled_search` (the same backends, variables and caching), with
    two functions compiled instead of one: the start (encoder, cache, the
    search's `init`) once per (batch, source bucket, beam size), and a
    segment of the search loop once per (rows, cache length, source bucket,
    beam size) met. Returns a driver with `compiled_search`'s arguments.
    """
    model_ref = weakref.ref(model)  # The cache must not keep the model alive.
    build = _build_jax_segments if keras.backend.backend() == "jax" else _build_tensorflow_segments
    pieces = _cache_for(model, "segments", lambda: build(model_ref))
    whole = compiled_search(model)

    def search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None):
        if not segments.pays(dim(encoder_token_ids, 0)):
            return whole(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name, options)
        return segments.run_segments(
            model, encoder_token_ids, max_lengths, alpha, beam_size, length, pieces, search_name, options or {}
        )

    return search


def _build_jax_segments(model_ref):
    import jax

    variables = list(model_ref().variables)

    def scope(values):
        return keras.StatelessScope(state_mapping=list(zip(variables, values)))

    def stateless_start(values, encoder_token_ids, options, beam_size, cache_length, search_name):
        with scope(values):
            return segments.start(model_ref(), encoder_token_ids, beam_size, cache_length, search_name, options)

    def stateless_advance(values, state, cache, max_lengths, alpha, length, leave_at, search_name, cache_length):
        with scope(values):
            return segments.advance(
                model_ref(), search_name, state, cache, max_lengths, alpha, length, cache_length, leave_at
            )

    start = jax.jit(stateless_start, static_argnames=("beam_size", "cache_length", "search_name"))
    advance = jax.jit(stateless_advance, static_argnames=("search_name", "cache_length"))

    def compiled_start(encoder_token_ids, beam_size, cache_length, search_name, options):
        return start(
            [v.value for v in variables], encoder_token_ids, options, beam_size=beam_size,
            cache_length=cache_length, search_name=search_name,
        )

    def compiled_advance(search_name, state, cache, max_lengths, alpha, length, cache_length, leave_at):
        return advance(
            [v.value for v in variables], state, cache, max_lengths, alpha, length, leave_at,
            search_name=search_name, cache_length=cache_length,
        )

    return compiled_start, compiled_advance


def _build_tensorflow_segments(model_ref):
    import tensorflow as tf

    # As `_build_tensorflow_search`: no autograph, one concrete function per shape.
    @tf.function(jit_compile=TF_JIT_COMPILE, autograph=False)
    def start(encoder_token_ids, beam_size, cache_length, search_name, options):
        return segments.start(model_ref(), encoder_token_ids, beam_size, cache_length, search_name, options)

    @tf.function(jit_compile=TF_JIT_COMPILE, autograph=False)
    def advance(search_name, state, cache, max_lengths, alpha, length, cache_length, leave_at):
        return segments.advance(
            model_ref(), search_name, state, cache, max_lengths, alpha, length, cache_length, leave_at
        )

    return _concrete_caller(start), _concrete_caller(advance)


def hybrid_search(model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None):
    """`loop.run_hybrid` with the search update compiled (TensorFlow, JAX)."""
    return loop.run_hybrid(
        model, encoder_token_ids, max_lengths, alpha, beam_size, length, lambda name: _compiled_update(name, model),
        search_name, options,
    )


def _compiled_update(search_name, model):
    """`loop.search_step` compiled, shared by models with the same ids.

    Only the model's ids and vocabulary size are read from `model`, so models
    that share them share the compiled function (traced once per shape).
    """
    constants = ModelConstants(model)

    def build():
        update = loop.search_step(search_name, constants)
        if keras.backend.backend() == "jax":
            import jax

            return jax.jit(update, static_argnames=("length",))
        import tensorflow as tf

        return tf.function(update, jit_compile=TF_JIT_COMPILE, autograph=False)

    key = (keras.backend.backend(), search_name, constants.key())
    if key not in _COMPILED_UPDATES:
        _COMPILED_UPDATES[key] = build()
    return _COMPILED_UPDATES[key]


def torch_step_search(
    model, encoder_token_ids, max_lengths, alpha, beam_size, length, search_name=None, options=None
):
    """PyTorch: `loop.run_steps` over one compiled step (`_torch_compiled_step`)."""

    def compiled_step(search, state, cache):
        return _torch_compiled_step(model, search, state, cache, max_lengths, alpha, length)

    return loop.run_steps(
        model, encoder_token_ids, max_lengths, alpha, beam_size, length, compiled_step, search_name, options
    )


def _torch_compiled_step(model, search, state, cache, max_lengths, alpha, length):
    """`loop.step` and the stopping test as one `torch.compile`d graph, cached per model and shape.

    The step is captured with `torch.export` (non-strict: Python runs once,
    so Keras' per-call overhead is gone, and no TorchDynamo tracing of
    Keras), with the variables as inputs (`keras.StatelessScope`, as for
    JAX, so later weight updates are seen), and the captured graph is run
    as it is (`TORCH_COMPILE_BACKEND = "export"`) or compiled with
    `torch.compile(backend=TORCH_COMPILE_BACKEND)`. Shapes are static: one
    graph per (search, batch, beam, source bucket, L).
    """
    import torch

    backend = TORCH_COMPILE_BACKEND
    shapes = tuple(
        tuple((name, tuple(x.shape), str(x.dtype)) for name, x in sorted(entries.items())) for entries in (state, cache)
    )
    key = ("torch_step", backend, search.NAME, length, shapes)
    model_ref = weakref.ref(model)  # The cache must not keep the model alive.
    variables = list(model.variables)

    class Step(torch.nn.Module):
        def forward(self, values, state, cache, max_lengths, alpha):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                state, cache = loop.step(model_ref(), search, state, cache, max_lengths, alpha)
                return state, cache, search.keep_going(state, max_lengths, alpha, length)

    def build():
        logger.info(
            "Capturing the PyTorch %s search step (%d rows, L=%d) for TORCH_COMPILE_BACKEND=%r",
            search.NAME, dim(next(iter(cache.values())), 0), length, backend,
        )
        # Traced once with the current index; it is a tensor input, so the graph serves every step.
        example = ([variable.value for variable in variables], state, cache, max_lengths, alpha)
        captured = torch.export.export(Step(), example, strict=False).module()
        if backend == "export":
            return captured
        # Compiled on the first call.
        return torch.compile(captured, backend=backend, fullgraph=True, dynamic=False)

    return _cache_for(model, key, build)
