"""Export a TransformerModel to ONNX: `python -m export.onnx`.

The graphs of `export.contract.ONNX` (where their tensors, dtypes and axes
are listed), traced by `export/graphs.py`, which `export/runtime.py` serves:

- `encoder.onnx`, `init_cache.onnx` and `decoder_step.onnx`: the methods of
  the generation protocol (`keras_transformer.generation`),
  `TransformerModel.encode`, `init_cache` and `decode_step`. Caches are
  heads first: `[batch, L, N, T_max, K]`.
- `greedy_search.onnx` and `beam_search.onnx`: `generation.search_graph`,
  the lengths, the encoder, the cache and the search's
  `keras.ops.while_loop`, which tf2onnx converts into an ONNX `Loop` with
  the search state and the caches as loop-carried values. One
  `session.run` translates a batch, with the search's own code (the tokens
  are Keras'); the beam size is an input, so one graph serves every beam.
  `beam_hypotheses.onnx` and `sample_search.onnx`: the same for
  `generate_hypotheses` (n-best, target prefixes, sampling).
- `fused_decoder_step.onnx`: the decoder step built for ONNX Runtime from
  the model's weights (`export/fused_step.py`: fused contrib ops, the
  self-attention cache written in place, the cross-attention cache once per
  source; int8 with `--quantize int8`), checked against `decode_step` at
  validation. With `beam_start.onnx` / `beam_update.onnx`,
  `sample_start.onnx` / `sample_update.onnx` and `greedy_update.onnx`
  (greedy search starts as sampling): `generation.start_graph` and
  `update_graph`, the same searches one update per call, for
  `export/steps.py`'s driver (rows that are done leave the batch; the cache
  grows with the output). Only for the models the fused step covers
  (float32, post-LN or pre-LN at opset 17; others keep the whole-search graphs, with a warning).

tf2onnx converts each graph with the handlers of `export/tf2onnx_support.py`;
then it is made leaner (`_convert`, with `export/graph_passes.py`): values the Loop
only carries along (the weights) become outer-scope initializers, Keras'
tensordot reshapes around matrix products are folded, and TensorFlow's
13-node layer norm becomes ONNX's `LayerNormalization`; every graph's
large tensors are then stored once, in `weights.bin` (`_share_weights`).

Why `init_cache` is its own graph rather than extra outputs of the encoder:
in the protocol, `init_cache` is a function of `encoder_outputs` and the
source ids, not a by-product of `encode`. Folded into the encoder graph, the
runtime would have to remember what `encode` returned and hand it out again
from `init_cache`, which is wrong as soon as a caller passes other encoder
outputs (tiled per beam, reordered, or computed elsewhere). Exporting
`init_cache` itself keeps one definition of the cache layout (`model.py`),
computes the cross-attention keys/values once per source, and lets ONNX
Runtime allocate the zero self-attention cache where it is used (on the GPU
under CUDA). The updated caches are named `updated_self_key` and
`updated_self_value` because an ONNX graph cannot reuse an input's name for
an output.

The directory is self-contained: the graphs, `weights.bin`, `config.json`
(ids, sizes, opset, exporting versions, format name and version) and the
tokenizer when the preset has one (ours, or an imported Marian checkpoint's
files: `export.runtime.OnnxTranslator` reads either). It is written next to its final place and renamed at the end, so a
failed export (conversion or validation) leaves nothing behind.

Example:

```
python -m export.onnx --preset path/to/preset --output exported/onnx
python -m export.onnx --preset path/to/preset --output exported/onnx-int8 --quantize int8 --from-float32 exported/onnx
python -m export.onnx --preset tiny --output exported/tiny-int8 --quantize int8
```

`--from-float32` quantizes the graphs of an existing float32 export of the
same preset rather than converting the model again (the conversion is most
of an export's time); the export is checked to be the preset's first.
"""

import json
import logging
import os
import pathlib
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

from export import contract  # noqa: E402
from export.fused_step import NotFusable, build_fused_step, fused_step_weights  # noqa: E402
# tf2onnx's handlers and speed-ups, and the passes over the converted graphs,
# have their own modules; their names stay importable from here (plain
# re-exports): `_convert` reads `CUSTOM_OP_HANDLERS` from this module, where
# tests patch it, and tests import `_graphs` from here.
from export.graph_passes import (  # noqa: E402
    _copy_outer_weights_into_loops, _drop_negative_index_fixes, _drop_no_op_pairs, _fold_constants,
    _fold_tensordot_reshapes, _fuse_layer_norms, _graphs, _hoist_loop_invariants, _remove_dead_nodes,
    _remove_unused_initializers,
)
from export.graphs import graph_functions  # noqa: E402
from export.tf2onnx_support import CUSTOM_OP_HANDLERS, _one_walk_subgraph_extraction, _optimize_in_place  # noqa: E402
from export.validate import QUANTIZATIONS, validate_onnx  # noqa: E402
from export.exporter import OVERWRITE_ARGUMENT, Exporter  # noqa: E402

# Named, not __name__, so that `python -m export.onnx` logs under the same name.
logger = logging.getLogger("export.onnx")

# Opset 17: the first with ONNX's LayerNormalization, which
# `_fuse_layer_norms` puts in place of TensorFlow's 13-node decomposition
# (ONNX Runtime >= 1.14 runs it). The graphs need opset 12 at least (Range and
# ScatterND for the cache update, `export/tf2onnx_support.py`; int64 Min/Max); tf2onnx 1.17 emits the
# same nodes at every opset from 13 to 17 (18 swaps the layer-norm
# GlobalAveragePools for ReduceMeans, which the fusion also matches).
# `--opset` picks another within tf2onnx's tested range (14-18); below 17 the
# layer norms stay unfused.
DEFAULT_OPSET = 17
MIN_OPSET = 14
MAX_OPSET = 18  # The newest opset tf2onnx 1.17 knows.


def _optimizers():
    """tf2onnx's optimizers without the pass that miscompiles attention (`keras_export.tf2onnx_optimizers`)."""
    from keras_transformer.keras_export import tf2onnx_optimizers

    return tf2onnx_optimizers()


def _convert(function, input_signature, opset, path):
    """Converts one tf.function with tf2onnx and writes it to `path`.

    The steps of `tf2onnx.convert.from_function`, with four changes: an
    op tf2onnx cannot convert is an error (tf2onnx logs it and leaves it in
    the graph), the optimizer list of `_optimizers()` (run by
    `_optimize_in_place`), unused nodes found in one walk
    (`_extract_sub_graph_nodes`), and
    `_fold_tensordot_reshapes` afterwards.
    """
    import onnx
    import tensorflow as tf
    from tf2onnx import convert, optimizer, tf_loader, tfonnx

    # No autograph: the functions are keras.ops and explicit tf.cond/while
    # (its source transformation cost 10-15 s per export process).
    concrete = tf.function(function, autograph=False).get_concrete_function(*input_signature)
    input_names = [t.name for t in concrete.inputs if t.dtype != tf.resource]
    output_names = [t.name for t in concrete.outputs if t.dtype != tf.resource]
    # Graph inputs and outputs take the names of the TensorSpecs and of the
    # returned dict's keys.
    renames = convert.tensor_names_from_structed(concrete, input_names, output_names)
    with tf.device("/cpu:0"):
        graph_def = tf_loader.from_function(concrete, input_names, output_names)
    with tf.Graph().as_default() as tf_graph, _one_walk_subgraph_extraction():
        tf.import_graph_def(graph_def, name="")

        def onnx_graph():
            try:
                return tfonnx.process_tf_graph(
                    tf_graph,
                    continue_on_error=False,
                    opset=opset,
                    custom_op_handlers=dict(CUSTOM_OP_HANDLERS),
                    input_names=input_names,
                    output_names=output_names,
                    tensors_to_rename=renames,
                )
            except Exception as error:
                raise RuntimeError(f"tf2onnx could not convert {path.name} at opset {opset}: {error}") from error

        # With catch_errors, tf2onnx deep-copies the whole graph before each
        # optimizer pass, to restore it if the pass fails: a third of the
        # conversion time of a search graph. The passes run in place first;
        # only if one fails is the graph converted again and optimized the
        # careful way (the same result where no pass fails).
        graph = onnx_graph()
        try:
            graph = _optimize_in_place(graph, _optimizers())
        except Exception:  # a tf2onnx optimizer pass failed on this graph
            logger.debug("tf2onnx optimizer failed in place on %s; optimizing a fresh copy pass by pass", path.name)
            graph = optimizer.optimize_graph(onnx_graph(), catch_errors=True, optimizers=_optimizers())
        model_proto = graph.make_model(f"keras_transformer {path.stem}")
    _hoist_loop_invariants(model_proto.graph)
    for subgraph in _graphs(model_proto.graph):
        _fold_tensordot_reshapes(subgraph)
        _drop_negative_index_fixes(subgraph)
    _remove_dead_nodes(model_proto.graph)
    _drop_no_op_pairs(model_proto)
    _fold_constants(model_proto)
    if opset >= 17:  # ONNX's LayerNormalization
        _fuse_layer_norms(model_proto)
    _remove_unused_initializers(model_proto.graph)
    # tf2onnx logs the TensorFlow ops it has no handler for and leaves them in
    # the graph; fail here, naming them, rather than when a runtime loads it.
    unconverted = sorted(
        {node.op_type for node in model_proto.graph.node if not onnx.defs.has(node.op_type, node.domain or "")}
    )
    if unconverted:
        raise RuntimeError(
            f"tf2onnx could not convert the TensorFlow op(s) {unconverted} of {path.name} at opset {opset}"
        )
    onnx.checker.check_model(model_proto)
    onnx.save(model_proto, str(path))


def _quantize_int8(path):
    """ONNX Runtime dynamic quantization of `path`, in place.

    Weights int8 (per tensor), activations quantized at run time from their
    observed range: MatMuls become MatMulInteger, and the embedding Gather
    reads 8-bit weights through a DequantizeLinear. Without the
    `quant_pre_process` that ONNX Runtime suggests in a warning: its
    symbolic shape inference cannot follow these graphs' shape arithmetic.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    float_path = path.with_name(path.stem + ".float32.onnx")
    model_proto = onnx.load(str(path))
    _copy_outer_weights_into_loops(model_proto)
    onnx.save(model_proto, str(float_path))
    path.unlink()
    # EnableSubgraph: also the matrix products inside the search's Loop body.
    quantize_dynamic(
        str(float_path), str(path), weight_type=QuantType.QInt8, extra_options={"EnableSubgraph": True}
    )
    float_path.unlink()


# Every graph holds the weights it uses (the search graphs hold the whole
# model); they are stored once, in this file beside the graphs.
WEIGHTS_FILE = "weights.bin"
# Smaller tensors (shapes, scalars) stay inside their graph.
_SHARED_MIN_BYTES = 1024


def _share_weights(directory, paths):
    """Moves the graphs' large initializers into one file, each distinct tensor once.

    ONNX external data: a tensor records a file, offset and length instead of
    its bytes. Five graphs that each hold the model's weights (the protocol
    graphs and the two whole-search graphs) then take the disk space of one
    copy. Offsets are 64-byte aligned so that ONNX Runtime can map them.
    """
    import hashlib

    import onnx
    from onnx.external_data_helper import set_external_data

    offsets = {}  # (dtype, dims, sha256) -> (offset, length)
    with open(directory / WEIGHTS_FILE, "wb") as weights:
        for path in paths:
            model_proto = onnx.load(str(path))
            for graph in _graphs(model_proto.graph):
                for tensor in graph.initializer:
                    if not tensor.HasField("raw_data") or len(tensor.raw_data) < _SHARED_MIN_BYTES:
                        continue
                    data = tensor.raw_data
                    key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).hexdigest())
                    if key not in offsets:
                        weights.write(b"\0" * (-weights.tell() % 64))
                        offsets[key] = (weights.tell(), len(data))
                        weights.write(data)
                    offset, length = offsets[key]
                    set_external_data(tensor, WEIGHTS_FILE, offset=offset, length=length)
                    tensor.ClearField("raw_data")
            onnx.save(model_proto, str(path))
    return len(offsets)


def _config(model, files, opset, quantize):
    """config.json: the format, the graph files, the model's ids and sizes, the exporting versions."""
    return {
        **contract.ONNX.header(),
        "graphs": files,
        "weights": WEIGHTS_FILE,
        "opset": opset,
        "quantization": quantize,
        **contract.model_fields(model),
        # onnxruntime is only needed to quantize and validate.
        "versions": contract.versions("tensorflow", "tf2onnx", "onnx", optional=("onnxruntime",)),
    }


def _load_model(preset):
    """The model to export (`Exporter.load_model`: dropout off, LoRA merged, TensorFlow only)."""
    return EXPORTER.load_model(preset)


def _reusable_graphs(directory, model, opset, names, atol):
    """The graph files of `names` in the float32 export `directory` of `model` at `opset` (checked)."""
    from export.validate import check_float32_export

    directory = pathlib.Path(directory)
    check_float32_export(directory, model, atol=atol)
    config = json.loads((directory / contract.CONFIG_FILE).read_text())
    if config.get("opset") != opset:
        raise ValueError(
            f"{directory} was exported at opset {config.get('opset')}; opset={opset} was asked for "
            f"(pass --opset {config.get('opset')})"
        )
    missing = [name for name in names if name not in config["graphs"]]
    if missing:
        raise ValueError(f"{directory} lacks the graphs {missing}; export the model again without float32_export")
    return {name: directory / config["graphs"][name] for name in names}


def _inline_weights(source, path):
    """Writes the graph `source` to `path` with its weights inside it (they are in `WEIGHTS_FILE` beside `source`).

    The graph as `_convert` wrote it before `_share_weights` moved the
    weights out: the same tensors, with no external-data fields.
    """
    import onnx

    model_proto = onnx.load(str(source))  # reads the weights beside it
    for graph in _graphs(model_proto.graph):
        for tensor in graph.initializer:
            tensor.ClearField("data_location")
    onnx.save(model_proto, str(path))


def is_onnx_export(directory):
    """Whether a directory is an export of `export_onnx`, of any format version (the oldest had no "format")."""
    directory = pathlib.Path(directory)
    oldest = (directory / contract.CONFIG_FILE).is_file() and any(directory.glob("*.onnx"))
    return contract.is_export_of(contract.ONNX)(directory) or oldest


EXPORTER = Exporter(
    "ONNX", "python -m export.onnx", "an ONNX export", is_onnx_export,
    tensorflow_because="tf2onnx converts TensorFlow graphs", int8_instead="--quantize int8 (ONNX Runtime's int8)",
    languages=True,
)


def check_output(output, overwrite, preset=None, flag=OVERWRITE_ARGUMENT):
    """`utils.check_output_directory` for an ONNX export: only an earlier ONNX export is replaced."""
    return EXPORTER.check_output(output, overwrite, preset, flag=flag)


def export_onnx(preset, output, opset=DEFAULT_OPSET, quantize=None, overwrite=False, atol=1e-4, float32_export=None,
                with_tokenizer=False):
    """Exports a TransformerModel to an ONNX Runtime directory and validates it.

    Args:
        preset: a built-in preset name, a preset directory (from
            `save_to_preset`), a Marian checkpoint directory or `hf://`
            handle (imported by `TransformerModel.from_preset`), or a
            `TransformerModel`.
        output: directory to create.
        opset: int, ONNX opset in `[14, 18]`. Defaults to 17 (see
            `DEFAULT_OPSET`).
        quantize: `None` (float32) or `"int8"` (ONNX Runtime dynamic
            quantization of the weights; checked for names and shapes, its
            accuracy is measured with BLEU, not a tolerance).
        overwrite: bool, replace an existing `output`.
        atol: float, tolerance of the float32 graphs against Keras.
        float32_export: with `quantize="int8"`, a float32 export of the
            same model (this function's output without `quantize`) whose
            graphs are quantized instead of converted again (the tf2onnx
            conversion is most of an export's time). Checked first
            (`export.validate.check_float32_export`): its config, opset and
            graphs, and the values of its encoder and decoder step.
        with_tokenizer: bool, also write `translate.onnx` (text in, text
            out; `export.text_graph.write_text_graph`, validated) into the
            export. Whether it can be written (a tokenizer the graph
            reproduces, onnxruntime-extensions) is checked before anything
            is converted.

    Returns:
        `pathlib.Path` of the exported directory.

    Raises:
        FileExistsError: `output` exists and `overwrite` is False.
        ValueError: `output` is the preset's directory, or not an earlier
            ONNX export (`check_output`).
        export.validate.ValidationError: the graphs differ from the model, or
            `float32_export` is not a float32 export of it.
    """
    if opset is None:
        opset = DEFAULT_OPSET
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} must be an int in [{MIN_OPSET}, {MAX_OPSET}]")
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r} must be one of {QUANTIZATIONS}")
    if float32_export is not None and quantize is None:
        raise ValueError(
            f"float32_export={str(float32_export)!r} is only read to quantize (quantize='int8'); "
            "a float32 export is already that directory"
        )
    output = check_output(output, overwrite, preset)

    model = _load_model(preset)
    if with_tokenizer:
        from export.text_graph import check_text_graph_support

        check_text_graph_support(model.tokenizer, preset if isinstance(preset, (str, os.PathLike)) else "the model")
    try:
        fused = build_fused_step(fused_step_weights(model, opset), quantize=quantize, opset=opset)
    except NotFusable as error:
        # The step driver needs the fused step; without it the server runs the whole-search graphs.
        logger.warning("No step driver graphs: %s", error)
        fused = None
    names = [name for name in contract.ONNX.graphs if fused is not None or name not in contract.STEP_DRIVER_GRAPHS]
    files = {name: f"{name}.onnx" for name in names}
    converted = [name for name in names if name != "fused_decoder_step"]
    if float32_export is not None:
        reused = _reusable_graphs(float32_export, model, opset, converted, atol)
    with EXPORTER.staged(output, overwrite, preset) as staging:
        if float32_export is None:
            for name, (function, signature) in graph_functions(model, converted).items():
                path = staging / files[name]
                logger.info("Converting %s (opset %d)", path.name, opset)
                _convert(function, signature, opset, path)
        else:
            for name in converted:
                logger.info("Reading %s from %s", files[name], float32_export)
                _inline_weights(reused[name], staging / files[name])
        if quantize == "int8":
            for name in converted:
                logger.info("Quantizing %s to int8", files[name])
                _quantize_int8(staging / files[name])
        if fused is not None:
            import onnx

            onnx.save(fused, str(staging / files["fused_decoder_step"]))
        _share_weights(staging, [staging / file for file in files.values()])
        config = _config(model, files, opset, quantize)
        contract.write_config(staging, config)
        if model.tokenizer is not None:
            model.tokenizer.save(staging)
        logger.info("Validating %s against the Keras model", output)
        validate_onnx(staging, model, atol=atol)
        if with_tokenizer:
            from export.text_graph import write_text_graph

            write_text_graph(staging)
    return output


def main(argv=None):
    parser = EXPORTER.parser(
        "Export a TransformerModel to ONNX (encoder, init_cache and cached decoder step) and validate it against Keras."
    )
    parser.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET,
        help=f"ONNX opset, {MIN_OPSET}-{MAX_OPSET} (default {DEFAULT_OPSET})",
    )
    parser.add_argument("--quantize", choices=[q for q in QUANTIZATIONS if q], default=None,
                        help="dynamic int8 quantization of the weights")
    parser.add_argument("--from-float32", metavar="DIR", default=None,
                        help="with --quantize int8: quantize the graphs of DIR, a float32 export of the same "
                        "preset, instead of converting the model again (checked against the preset first)")
    parser.add_argument("--with-tokenizer", action="store_true",
                        help="also write translate.onnx: text in, text out (needs onnxruntime-extensions)")
    return EXPORTER.main(parser, argv, lambda args: export_onnx(
        args.preset, args.output, opset=args.opset, quantize=args.quantize, overwrite=args.overwrite,
        float32_export=args.from_float32, with_tokenizer=args.with_tokenizer,
    ))


if __name__ == "__main__":
    sys.exit(main())
