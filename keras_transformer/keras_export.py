"""Keras' own export of a `TransformerModel`'s forward pass (`TransformerModel.export`), and tf2onnx's passes.

The forward pass only (token ids in, logits out): Keras' `Model.export`,
with the model's input signature by default, a one-line refusal where Keras
cannot export this model (naming the project's exporter, which exports the
search too), and tf2onnx without the pass that miscompiles attention, which
`python -m export.onnx` leaves out as well (`tf2onnx_optimizers`).
"""

import contextlib

import keras

# Keras' exporters by format, and the project's own, which export the
# search too (encoder, decoder step, cache), for where Keras' cannot.
PROJECT_EXPORTERS = {"onnx": "python -m export.onnx", "tf_saved_model": "python -m export.saved_model"}


def export(model, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs):
    """`TransformerModel.export` of a model without LoRA adapters (the method's docstring has the details)."""
    backend = keras.backend.backend()
    alternative = PROJECT_EXPORTERS.get(format)
    if isinstance(input_signature, (list, tuple)) and len(input_signature) != 1:
        # Keras passes each entry as a positional argument of `call`.
        raise ValueError(
            f"input_signature has {len(input_signature)} entries; the model takes one dict of inputs: "
            "pass [{name: keras.InputSpec(...)}] for encoder_token_ids and decoder_token_ids"
        )

    def refusal(reason):
        return RuntimeError(
            f"Keras cannot export a TransformerModel to format={format!r} on the {backend} backend "
            f"({reason}); use `{alternative} --preset DIR --output OUT` (TensorFlow backend) instead"
        )

    if alternative and backend == "torch":
        if format == "tf_saved_model":
            raise refusal("its PyTorch SavedModel export takes one tensor, not the dict of token ids")
        fixed_shapes = (
            "PyTorch's exporter fixes the shapes; for fixed shapes pass "
            "input_signature=[{name: keras.InputSpec(shape=(B, L), dtype='int32', name=name)}] "
            "for encoder_token_ids and decoder_token_ids"
        )
        if input_signature is None:
            raise refusal(f"for any batch and length: {fixed_shapes}")
        unknown = _specs_with_unknown_sizes(input_signature)
        if unknown:
            raise refusal(f"input_signature has unknown sizes ({', '.join(unknown)}): {fixed_shapes}")
    if input_signature is None:
        input_signature = model.export_input_signature()
    with _tf2onnx_without_reshape_merge(active=format == "onnx" and backend == "tensorflow"):
        try:
            return keras.Model.export(
                model, filepath, format=format, verbose=verbose, input_signature=input_signature, **kwargs
            )
        except (ImportError, NotImplementedError) as error:
            if alternative is None:
                raise
            raise refusal(f"{type(error).__name__}: {' '.join(str(error).split())[:200]}") from error

def _specs_with_unknown_sizes(input_signature):
    """`"name shape"` of each spec in `input_signature` (nested lists, tuples, dicts) with a None size."""
    found = []
    for spec in keras.tree.flatten(input_signature):
        shape = getattr(spec, "shape", None)
        if shape is not None and any(size is None for size in shape):
            found.append(f"{getattr(spec, 'name', None) or 'input'} {tuple(shape)}")
    return found


@contextlib.contextmanager
def _tf2onnx_without_reshape_merge(active=True):
    """Keras' ONNX export (tf2onnx) without tf2onnx's back-to-back Reshape merge.

    tf2onnx 1.17's "remove_back_to_back" optimizer miscompiles the attention
    head split after a `Dense` on `[B, T, D]`: the graph then runs only at the
    traced shape (`tf2onnx_optimizers` has the details; `python -m
    export.onnx` uses the same list). Keras' `export_onnx` passes no optimizer list to
    `tf2onnx.convert.from_function`, so the list is narrowed here, for the
    duration of the export only.
    """
    if not active:
        yield
        return
    from unittest import mock

    from tf2onnx import optimizer

    every = optimizer._get_optimizers
    with mock.patch.object(optimizer, "_get_optimizers", lambda: tf2onnx_optimizers(every)):
        yield


# tf2onnx passes not run: the back-to-back merge (see `tf2onnx_optimizers`), and
# four that never change this model's graphs (no Upsample, no Q/DQ pairs:
# int8 is quantized afterwards by ONNX Runtime's quantizer; no loop-invariant
# Transpose/Squeeze for the loop pass): each pass walks the whole graph every
# round, and these four were a fifth of the conversion time of an export.
_TF2ONNX_PASSES_LEFT_OUT = (
    "remove_back_to_back", "remove_redundant_upsample", "const_dequantize_optimizer", "q_dq_optimizer",
    "loop_optimizer",
)


def tf2onnx_optimizers(every=None):
    """tf2onnx's graph optimizers, without the back-to-back Reshape merge and the passes that change nothing here.

    tf2onnx 1.17 miscompiles Keras' attention projections with all its
    optimizers on: `Dense` on a `[B, T, D]` input is a tensordot (reshape
    to `[B * T, D]`, MatMul, reshape back to `[B, T, N * H]`) followed by
    the head split `reshape(x, (B, T, N, H))`. The reshape optimizer turns
    the head split's computed shape into `[0, 0, N, H]` ("copy dims 0 and 1
    from the input"), then the back-to-back optimizer merges the two
    reshapes, so the zeros copy `[B * T, N * H]` from the 2-D MatMul output
    and the graph fails (or is wrong) for every length but the traced one.
    Dropping the back-to-back pass (it only merges chains of Cast, Reshape,
    Transpose, Squeeze/Unsqueeze, which ONNX Runtime's own graph optimizer
    also fuses when it loads the model) keeps everything else;
    `export/validate.py` catches this class of error. Used by
    `python -m export.onnx` and by `TransformerModel.export(format="onnx")`.

    Args:
        every: tf2onnx's `_get_optimizers` (the default: tf2onnx has no
            public list; `from_function` uses it).
    """
    if every is None:
        from tf2onnx import optimizer

        every = optimizer._get_optimizers
    return {name: factory for name, factory in every().items() if name not in _TF2ONNX_PASSES_LEFT_OUT}
