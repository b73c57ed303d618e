"""Export a TransformerModel to a TensorFlow SavedModel: `python -m export.saved_model`.

Text in, text out, in one graph that TensorFlow Serving, `tf.saved_model.load`
or any TensorFlow runtime can run without this package. Signatures:

- `translate`: `text [B] string -> translation [B] string`. Tokenization
  (TensorFlow Text's SentencePiece op, built from the tokenizer's proto; for
  an imported Marian checkpoint's tokenizer, `source.spm`'s pieces looked up
  in its vocabulary, as `MarianTokenizer`: `_in_graph_tokenizer`), the
  beam search of `keras_transformer.generation` (the same compiled search
  `Translator` runs, with the export-time `beam_size`, `length_penalty` and
  `max_extra_length`; `beam_size=1` is greedy) and detokenization. Sources
  are encoded as `Translator` encodes them (tokens + end id, cut to
  `max_sequence_length` with the end id kept), and empty or whitespace-only
  strings give empty strings, so the outputs equal
  `Translator.translate(texts, beam_size, ...)`; unlike `Translator`, a
  request is one batch (not split into batches of 32).
- `encode`, `init_cache` and `decode_step`: the methods of the generation
  protocol, the functions of the ONNX export's `encoder`, `init_cache` and
  `decoder_step` graphs (`export/graphs.py`, same input and output names),
  for callers that run their own search.

Their tensors, dtypes and axes are `export.contract.SAVED_MODEL` (also in
the directory's config.json, `signatures`); every axis named B, S or T_max
is dynamic, and the export checks each signature against the contract.

The graph holds only TensorFlow and TensorFlow Text ops and the weights as
plain variables: loading needs TensorFlow and the SentencePiece ops of
TensorFlow Text, registered by `import tensorflow_text`, and neither Keras
nor keras_transformer:

```python
import tensorflow as tf
import tensorflow_text  # noqa: F401 - registers the SentencePiece ops

translate = tf.saved_model.load("DIR").signatures["translate"]
translate(text=tf.constant(["A sentence."]))["translation"]
```

The search is compiled with XLA (`generation.TF_JIT_COMPILE`), as in Keras:
once per batch size, source length bucket and output length bucket, so a
server pays a compilation (seconds on a CPU) for each new shape; send a few
fixed batch sizes, or set `keras_transformer.generation.TF_JIT_COMPILE =
False` before exporting for a plain graph (the same search, not bit-for-bit
the numbers of the XLA-compiled one).

The directory is self-contained: the SavedModel, the tokenizer's files
(`tokenizer.model`, or an imported checkpoint's `source.spm`, `target.spm`,
`vocab.json` and `marian_tokenizer.json`) and `config.json` (ids, sizes,
search settings, signatures, exporting versions). It is written next to its
final place and renamed at the end, so a failed export leaves nothing behind.

Example:

```
python -m export.saved_model --preset path/to/preset --output exported/saved_model
python -m export.saved_model --preset path/to/preset --output exported/greedy --beam-size 1
```
"""

import logging
import os
import pathlib
import sys

from keras_transformer import cli

if __name__ == "__main__":  # a command: quiet the frameworks before anything imports them
    cli.quiet_startup()

from export import contract  # noqa: E402
from export.exporter import OVERWRITE_ARGUMENT, Exporter  # noqa: E402
from export.graphs import graph_functions  # noqa: E402
from keras_transformer.decoding import check_search_args  # noqa: E402

logger = logging.getLogger("export.saved_model")

# Translator skips texts for which `text.strip()` is empty.
_BLANK = contract.WHITESPACE_RE2 + "*"


def _load(preset_or_model, tokenizer):
    """`(model, tokenizer)`, checked against each other; a clear error when there is no tokenizer."""
    from keras_transformer.presets import TOKENIZER_FILE
    from keras_transformer.translator import Translator

    model = EXPORTER.load_model(preset_or_model, argument="preset_or_model")
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    if tokenizer is None:
        if not isinstance(preset_or_model, (str, os.PathLike)):
            where = "the model has no tokenizer attached"
        elif os.path.isdir(preset_or_model):
            where = f"the directory {os.fspath(preset_or_model)!r} has no {TOKENIZER_FILE}"
        else:
            where = f"{preset_or_model!r} is a built-in architecture preset (random weights, no tokenizer)"
        raise ValueError(
            f"Cannot export a SavedModel without a tokenizer ({where}): the translate signature "
            "tokenizes in the graph. Pass tokenizer=... (a keras_transformer Tokenizer), or a preset "
            "directory written by save_to_preset(directory, tokenizer=...)."
        )
    Translator(model, tokenizer)  # Checks that vocabulary and special ids match.
    return model, tokenizer


def _serving_module(model, tokenizer, beam_size, length_penalty, max_extra_length):
    """A `tf.Module` holding the variables and the tokenizer; returns `(module, signatures)`."""
    import tensorflow as tf

    from keras_transformer.generation import generate_in_graph

    module = tf.Module()
    # Only what the graphs read is saved: the weights (Keras variables are
    # tf.Variables on this backend) and the SentencePiece resource, so that
    # loading builds no Keras object.
    module.model_variables = list(model.variables)
    tokenize, detokenize = _in_graph_tokenizer(module, tokenizer)
    limit = model.max_sequence_length
    pad_id, end_id = model.pad_id, model.end_id

    def source_ids(text):
        """`[B] string -> [B, None] int32` ragged: as `Translator.encode`, tokens + end id."""
        pieces = tokenize(text)[:, : limit - 1]  # [B, (n)]
        ends = tf.RaggedTensor.from_tensor(tf.fill([tf.shape(text)[0], 1], tf.constant(end_id, tf.int32)))
        return tf.concat([pieces, ends], axis=1)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")], autograph=False)
    def translate(text):
        sources = source_ids(text)  # [B, (n)]
        # Empty or whitespace-only texts (nothing but the end id) give "" without running the model.
        blank = tf.strings.regex_full_match(text, _BLANK)
        todo = tf.where(tf.logical_and(sources.row_lengths() > 1, tf.logical_not(blank)))[:, 0]  # [B']
        empty = tf.fill(tf.shape(text), "")

        def search():
            ids = tf.gather(sources, todo).to_tensor(default_value=pad_id)  # [B', S]
            sequences, _ = generate_in_graph(
                model, ids, beam_size=beam_size, length_penalty=length_penalty, max_extra_length=max_extra_length
            )
            return tf.tensor_scatter_nd_update(empty, todo[:, None], detokenize(sequences))

        translation = tf.cond(tf.size(todo) > 0, search, lambda: empty)
        return {"translation": tf.ensure_shape(translation, [None])}

    signatures = {"translate": translate.get_concrete_function()}
    # The protocol signatures are graphs of the ONNX export under other names: the same functions.
    functions = graph_functions(model)
    onnx_names = {graph: name for name, graph in contract.ONNX.graphs.items()}
    for name, graph in contract.SAVED_MODEL.graphs.items():
        if graph in onnx_names:
            function, input_signature = functions[onnx_names[graph]]
            signatures[name] = tf.function(
                function, input_signature=input_signature, autograph=False
            ).get_concrete_function()
    sizes = contract.model_fields(model)
    for name, signature in signatures.items():
        check_signature(name, signature, sizes, model.compute_dtype)
    return module, signatures


def _in_graph_tokenizer(module, tokenizer):
    """`(tokenize, detokenize)`: `tokenizer.encode` (no end id) and `.decode` as TensorFlow functions.

    `tokenize`: `[B]` string -> `[B, (n)]` int32 ragged ids. `detokenize`:
    `[B, L]` int32 ids -> `[B]` string (cut at the first end id). Their
    resources (the SentencePiece model, a lookup table) are attributes of
    `module`, so that the SavedModel holds them.

    Our `Tokenizer`: TensorFlow Text's SentencePiece op on its proto. A
    `MarianTokenizer`: the same op on `source.spm`, returning pieces as
    text (a run of unknown characters is one piece, its text), looked up in
    our vocabulary (unk when absent), after a leading `>>xx<<` made one unk
    id; on the way out, our ids as their pieces, joined, "▁" made a space,
    stripped, as `MarianTokenizer.decode`.

    Raises:
        ValueError: a multilingual Marian vocabulary (`>>xx<<` codes), which
            the graph cannot check as `MarianTokenizer.encode` does.
    """
    import tensorflow as tf

    from export.text_graph import LANGUAGE_CODE_RE2, marian_target_pieces
    from keras_transformer.tokenizers.marian import SPIECE_UNDERLINE
    from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID

    end_id = tokenizer.end_id

    def before_end(sequences):
        return tf.equal(tf.cumsum(tf.cast(tf.equal(sequences, end_id), tf.int32), axis=1), 0)

    if tokenizer.sentencepiece_ids:
        # The end id is appended by the caller, after cutting to max_sequence_length.
        module.tokenizer = tokenizer.tf_text_tokenizer(add_start=False, add_end=False)

        def detokenize(sequences):
            """As `Tokenizer.decode`: cut at the first end id, drop pad and start."""
            keep = before_end(sequences) & tf.not_equal(sequences, tokenizer.pad_id)
            keep &= tf.not_equal(sequences, tokenizer.start_id)
            return module.tokenizer.detokenize(tf.ragged.boolean_mask(sequences, keep))

        return module.tokenizer.tokenize, detokenize

    if tokenizer.language_codes:
        raise ValueError(
            f"The SavedModel's translate signature does not support this multilingual model "
            f"({len(tokenizer.language_codes)} target-language codes such as {tokenizer.language_codes[0]!r}: the "
            "graph cannot check that each text starts with one); translate with keras_transformer.Translator, or "
            "export ONNX and use export.runtime.OnnxTranslator"
        )
    import tensorflow_text

    module.tokenizer = tensorflow_text.SentencepieceTokenizer(model=tokenizer.source_proto, out_type=tf.string)
    pieces = tokenizer.source_vocabulary()  # the source's ids (its own vocabulary, or the shared one)
    module.piece_ids = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(pieces), tf.range(len(pieces), dtype=tf.int32)),
        default_value=tokenizer.unk_id,
    )
    target_pieces = marian_target_pieces(tokenizer)

    def tokenize(text):
        rest = tf.strings.regex_replace(text, LANGUAGE_CODE_RE2, "", replace_global=False)
        has_code = tf.not_equal(rest, text)  # [B]: its code is one piece, outside the vocabulary
        ids = tf.ragged.map_flat_values(module.piece_ids.lookup, module.tokenizer.tokenize(rest))  # [B, (n)]
        codes = tf.fill([tf.shape(text)[0], 1], tf.constant(tokenizer.unk_id, tf.int32))
        return tf.concat([tf.ragged.boolean_mask(codes, has_code[:, None]), ids], axis=1)

    def detokenize(sequences):
        """As `MarianTokenizer.decode`: cut at the first end id, ordinary ids as pieces, joined, spaced, stripped."""
        keep = before_end(sequences) & tf.greater_equal(sequences, FIRST_ORDINARY_ID)
        joined = tf.strings.reduce_join(tf.gather(tf.constant(target_pieces), tf.ragged.boolean_mask(sequences, keep)),
                                        axis=1)
        spaced = tf.strings.regex_replace(joined, SPIECE_UNDERLINE, " ")
        return tf.strings.regex_replace(spaced, f"^{contract.WHITESPACE_RE2}+|{contract.WHITESPACE_RE2}+$", "")

    return tokenize, detokenize


def check_signature(name, signature, sizes, compute_dtype):
    """Checks one concrete function (or a loaded signature) against `contract.SAVED_MODEL.graphs[name]`.

    Raises:
        export.contract.ValidationError: naming the signature and the tensor.
    """
    graph = contract.SAVED_MODEL.graphs[name]
    # Traced functions hold their inputs by position (named by their TensorSpecs), loaded signatures by keyword.
    args, kwargs = signature.structured_input_signature
    inputs = {**{spec.name: spec for spec in args}, **kwargs}
    for kind, specs in (("inputs", inputs), ("outputs", signature.structured_outputs)):
        actual = [(key, spec.dtype.name, spec.shape.as_list()) for key, spec in specs.items()]
        contract.check_tensors(f"SavedModel signature {name}", graph, kind, actual, sizes, compute_dtype)


def _config(model, tokenizer, beam_size, length_penalty, max_extra_length):
    """config.json: the format, the signatures, the search settings, the model's ids and sizes, the versions."""
    return {
        **contract.SAVED_MODEL.header(),
        "signatures": contract.describe_graphs(contract.SAVED_MODEL, model.compute_dtype),
        "load": "import tensorflow_text (registers the SentencePiece ops), then tf.saved_model.load(directory)",
        # The file `load_tokenizer` recognises the tokenizer by, and all its files.
        "tokenizer": contract.tokenizer_files(tokenizer)[-1],
        "tokenizer_files": list(contract.tokenizer_files(tokenizer)),
        "beam_size": beam_size,
        "length_penalty": float(length_penalty),
        "max_extra_length": max_extra_length,
        **contract.model_fields(model),
        "unk_id": tokenizer.unk_id,
        "versions": contract.versions("tensorflow", "tensorflow_text"),
    }


def export_saved_model(
    preset_or_model,
    output,
    *,
    tokenizer=None,
    beam_size=4,
    length_penalty=0.6,
    max_extra_length=50,
    overwrite=False,
):
    """Exports a TransformerModel and its tokenizer as a TensorFlow SavedModel.

    Args:
        preset_or_model: a preset directory (from `save_to_preset`, with its
            tokenizer), a Marian checkpoint directory or `hf://` handle
            (imported by `TransformerModel.from_preset`), a built-in preset
            name (then `tokenizer` is required), or a `TransformerModel`.
        output: directory to create.
        tokenizer: a `keras_transformer.Tokenizer` or a `MarianTokenizer`
            (not a multilingual one); defaults to the preset's or the
            model's (`model.tokenizer`).
        beam_size: int >= 1, the `translate` signature's beam size (1 is
            greedy search). Defaults to 4 (the paper).
        length_penalty: float alpha >= 0. Defaults to 0.6 (the paper).
        max_extra_length: int >= 0, output tokens beyond the source length.
            Defaults to 50 (the paper).
        overwrite: bool, replace an existing `output`.

    Returns:
        `pathlib.Path` of the exported directory.

    Raises:
        FileExistsError: `output` exists and `overwrite` is False.
        ValueError: no tokenizer, or one that does not match the model;
            `output` is the preset's directory, or not an earlier
            SavedModel (`check_output`).
        RuntimeError: the Keras backend is not TensorFlow.

    Example:

    ```python
    export_saved_model("path/to/preset", "exported/saved_model", overwrite=True)
    ```
    """
    check_search_args(beam_size, length_penalty, max_extra_length)
    output = check_output(output, overwrite, preset_or_model)
    model, tokenizer = _load(preset_or_model, tokenizer)

    import tensorflow as tf

    with EXPORTER.staged(output, overwrite, preset_or_model) as staging:
        logger.info("Tracing the signatures %s", ", ".join(contract.SAVED_MODEL.graphs))
        module, signatures = _serving_module(model, tokenizer, beam_size, length_penalty, max_extra_length)
        logger.info("Writing the SavedModel")
        tf.saved_model.save(module, str(staging), signatures=signatures)
        tokenizer.save(staging)
        config = _config(model, tokenizer, beam_size, length_penalty, max_extra_length)
        contract.write_config(staging, config)
    return output


def is_saved_model_export(directory):
    """Whether a directory is a SavedModel: ours (config.json's format) or any (`saved_model.pb`)."""
    directory = pathlib.Path(directory)
    return contract.is_export_of(contract.SAVED_MODEL)(directory) or (directory / "saved_model.pb").is_file()


EXPORTER = Exporter(
    "SavedModel", "python -m export.saved_model", "a SavedModel", is_saved_model_export,
    tensorflow_because="it saves TensorFlow graphs", cli_errors=(FileNotFoundError, ValueError, RuntimeError),
)


def check_output(output, overwrite, preset=None, flag=OVERWRITE_ARGUMENT):
    """`utils.check_output_directory` for a SavedModel export: only an earlier SavedModel is replaced."""
    return EXPORTER.check_output(output, overwrite, preset, flag=flag)


def main(argv=None):
    parser = EXPORTER.parser(
        "Export a TransformerModel and its tokenizer as a TensorFlow SavedModel "
        "(signatures translate, encode, init_cache, decode_step).",
        preset_help="preset directory with a tokenizer (from save_to_preset), Marian checkpoint directory or "
        "hf://org/name",
    )
    parser.add_argument(
        "--beam-size", type=int, default=4, help="beam size of the translate signature; 1 is greedy (default 4)"
    )
    parser.add_argument("--length-penalty", type=float, default=0.6, help="length penalty alpha (default 0.6)")
    parser.add_argument(
        "--max-extra-length", type=int, default=50, help="output tokens allowed beyond the source length (default 50)"
    )
    return EXPORTER.main(parser, argv, lambda args: export_saved_model(
        args.preset, args.output, beam_size=args.beam_size, length_penalty=args.length_penalty,
        max_extra_length=args.max_extra_length, overwrite=args.overwrite,
    ))


if __name__ == "__main__":
    sys.exit(main())
