"""Text in, text out in one ONNX model: `translate.onnx`.

`write_text_graph(directory)` adds `translate.onnx` to a directory written
by `python -m export.onnx` from a preset with a tokenizer. The graph wraps
the exported `beam_search.onnx` and `greedy_search.onnx` in SentencePiece
encoding and decoding (the
`SentencepieceTokenizer` and `SentencepieceDecoder` custom operators of
onnxruntime-extensions, domain `ai.onnx.contrib`, with the directory's
`tokenizer.model` as their `model` attribute), so that any ONNX Runtime
binding (C++, C#, Java, JavaScript, Triton's ONNX Runtime backend) can
translate strings with no Python of ours, given the extensions library.

An imported Marian checkpoint's tokenizer (`MarianTokenizer`: `source.spm`,
`target.spm` and `vocab.json`) is followed exactly, with other nodes in
steps 1 and 4: `SentencepieceTokenizer` on `source.spm` (with the
vocabulary's pieces it does not know added: `marian_source_model`), a
Gather from its ids to ours, runs of unknown characters made one id, and a
leading `>>xx<<` made one unk id (`_marian_tokenize_nodes`); on the way
out, our ids as their pieces (a string Gather), joined, "▁" made a space,
stripped (`marian_target_pieces`). A multilingual vocabulary (`>>xx<<`
target-language codes) is refused (`check_tokenizer`): the graph cannot
refuse a text without its code as `MarianTokenizer.encode` does.

Inputs and outputs of `translate.onnx`:

- `text`: string `[batch]`, UTF-8 sentences.
- `beam_size`: int32 scalar, optional (default 4; 1 is greedy search).
- `alpha`: float32 scalar, optional, the GNMT length penalty (default 0.6).
- `max_extra_length`: int32 scalar, optional, output tokens beyond the
  source length (default 50).
- `translation`: string `[batch]`, in the order of `text`.

The optional inputs are graph inputs with an initializer of the same name
(ONNX's way of giving an input a default); the defaults are those of
`write_text_graph`'s arguments.

What the graph computes, step by step, as `keras_transformer.Translator`
does in Python (`translator.py`, `tokenizer.py`):

1. `SentencepieceTokenizer` encodes every text (no start or end id) into
   ragged pieces: values `[N]` and row splits `[batch + 1]`.
2. Each row keeps at most `max_sequence_length - 1` pieces (the
   Translator's truncation of long sources, which keeps the end id), gets
   the end id appended and is right-padded with 0 into an int32
   `[batch', width]` matrix, where batch' counts the texts with at least
   one piece (Gather from the values with per-row offsets; no Python).
3. If batch' > 0, a search graph's nodes run on that matrix: the greedy
   search's for `beam_size` 1, the beam search's otherwise, as the
   Translator chooses (embedded unchanged, the greedy one's names
   prefixed; the weights stay in the export's `weights.bin`, shared, not
   copied); texts without pieces (empty or whitespace-only) never reach the
   model, as in the Translator.
4. A Loop over the batch decodes each row: ids up to the first end id,
   pad and start ids dropped, then `SentencepieceDecoder` (which decodes
   one sequence per call); texts without pieces give "".

Where it differs from `export.runtime.OnnxTranslator` (the tests pin each):

- A text that only Python's `str.strip()` sees as whitespace: of the
  Unicode whitespace characters, U+0085 (NEL) alone is kept by
  SentencePiece's `nmt_nfkc` normalisation (as <unk>). The Translator
  returns "" for `"\x85"`; the graph translates the <unk> piece.
- The request is one batch (the Translator sorts by length and searches
  32 at a time): the same tokens, but memory grows with the request.
- The search arguments are not checked in the graph (ONNX has no assert):
  `beam_size` < 1 or negative `alpha`/`max_extra_length` are undefined.
- Nothing is logged (the Translator warns when it cuts a long source).

Do not create the session in a process that imported TensorFlow first:
onnxruntime-extensions 0.15.2 and TensorFlow 2.21 carry two protobuf
libraries and the process crashes (segmentation fault) when the session
is created. This module checks the graph in a child process for that
reason (`translate_in_subprocess`).

Example:

```python
import numpy as np
import onnxruntime as ort
import onnxruntime_extensions

options = ort.SessionOptions()
options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
session = ort.InferenceSession("exported/onnx/translate.onnx", options)
(translation,) = session.run(None, {"text": np.array(["A sentence."], dtype=object)})
```

```
python -m export.text_graph --model exported/onnx
```
"""

import argparse
import json
import logging
import pathlib
import sys
import typing

import numpy as np

from export import contract
from export.contract import CONFIG_FILE, ValidationError
from keras_transformer.marian_tokenizer import SPIECE_UNDERLINE
from keras_transformer.tokenizer import FIRST_ORDINARY_ID, load_tokenizer
from keras_transformer.tokenizer import TOKENIZER_FILENAME as TOKENIZER_FILE

logger = logging.getLogger("export.text_graph")

TEXT_GRAPH_FILE = "translate.onnx"
SEARCH_FILE = "beam_search.onnx"
GREEDY_FILE = "greedy_search.onnx"
# The custom-op domain of onnxruntime-extensions.
EXTENSIONS_DOMAIN = "ai.onnx.contrib"
# Version of the graph's layout, stored in its metadata.
# 2: greedy_search.onnx's nodes for beam_size 1 (1 ran a beam search of one beam).
TEXT_GRAPH_VERSION = 2
# Our own value names start with this; the beam search graph's keep theirs,
# the greedy one's get `_GREEDY_PREFIX`.
_PREFIX = "translate/"
_GREEDY_PREFIX = "greedy/"
# A leading `>>xx<<` target-language token, as `marian_tokenizer.split_language_code` finds it.
LANGUAGE_CODE_RE2 = r"^>>(?s:.*?)<<"


def _require_extensions():
    try:
        import onnxruntime_extensions
    except ImportError:
        raise ImportError(
            "translate.onnx needs onnxruntime-extensions (SentencePiece operators): "
            "pip install onnxruntime-extensions"
        ) from None
    return onnxruntime_extensions


def _graph_names(graph):
    """Every value name used in `graph` and its subgraphs."""
    names = {value.name for value in (*graph.input, *graph.output, *graph.value_info)}
    names.update(init.name for init in graph.initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                names |= _graph_names(attribute.g)
            for subgraph in attribute.graphs:
                names |= _graph_names(subgraph)
    names.discard("")
    return names


class _GraphBuilder:
    """Collects this graph's nodes and initializers, under `_PREFIX` names.

    `const` and `node` append in call order, so the graph is the same for
    the same sequence of calls. A node goes into `into` (a subgraph's node
    list) when given, else into the main graph; constants always become
    main-graph initializers (subgraphs read them from the outer scope).
    """

    def __init__(self):
        self.nodes, self.initializers = [], []

    @staticmethod
    def name(label):
        return _PREFIX + label

    def const(self, label, value, dtype):
        """Adds an initializer `_PREFIX + label` holding `value`; returns its name."""
        from onnx import numpy_helper

        tensor = numpy_helper.from_array(np.array(value, dtype), self.name(label))
        self.initializers.append(tensor)
        return tensor.name

    def node(self, op, inputs, outputs, into=None, **attributes):
        """Adds an `op` node named after its first output; returns its output name(s)."""
        from onnx import helper

        made = helper.make_node(op, inputs, outputs, name=outputs[0], **attributes)
        (self.nodes if into is None else into).append(made)
        return outputs[0] if len(outputs) == 1 else outputs


def _check_search_graph(search_model, spec=contract.BEAM_SEARCH, file=SEARCH_FILE):
    """Checks a search graph's inputs, outputs, opset (13 or newer) and value names.

    Args:
        search_model: `onnx.ModelProto` of `file`.
        spec: its `contract.Graph` (`BEAM_SEARCH` or `GREEDY_SEARCH`).

    Raises:
        ValueError: naming what the search graph has and what is expected.
    """
    search = search_model.graph
    expected_inputs = sorted(spec.input_names())
    if sorted(value.name for value in search.input) != expected_inputs:
        raise ValueError(
            f"The search graph has inputs {sorted(v.name for v in search.input)}; expected "
            f"{expected_inputs} ({file} of export format {contract.ONNX.version})"
        )
    if "sequences" not in {value.name for value in search.output}:
        raise ValueError(f"The search graph {file} has no `sequences` output")
    # Our nodes take the search's opset: they are the same from opset 13 to 18.
    opset = next(o.version for o in search_model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 13:
        raise ValueError(f"The search graph {file} has opset {opset}; translate.onnx needs 13 or newer")
    clash = sorted(
        n for n in _graph_names(search)
        if n.startswith((_PREFIX, _GREEDY_PREFIX)) or n in ("text", "translation")
    )
    if clash:
        raise ValueError(f"The search graph {file} uses names reserved for translate.onnx: {clash[:5]}")


def _subgraphs(graph):
    """`graph` and every graph below it (the bodies and branches of its nodes)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                yield from _subgraphs(attribute.g)
            for subgraph in attribute.graphs:
                yield from _subgraphs(subgraph)


def _tensor_key(tensor):
    """The tensor without its name: equal for equal values (or the same place in weights.bin)."""
    from onnx import TensorProto

    unnamed = TensorProto()
    unnamed.CopyFrom(tensor)
    unnamed.name = ""
    return unnamed.SerializeToString()


def _greedy_graph(greedy_model, beam_graph):
    """`greedy_search.onnx`'s graph, to run beside the beam search's in one model.

    Every value it defines gets `_GREEDY_PREFIX` (both graphs come from
    tf2onnx, whose names repeat with other meanings); it still reads the
    search inputs by their names. Its initializers that equal one of the beam
    search's (the weights: the same bytes of `weights.bin`) read that one
    instead, so the weights are held once.

    Returns:
        `onnx.GraphProto`, whose `sequences` output is `_GREEDY_PREFIX + "sequences"`.
    """
    from onnx import GraphProto

    graph = GraphProto()
    graph.CopyFrom(greedy_model.graph)
    defined = set()
    for inner in _subgraphs(graph):
        defined.update(tensor.name for tensor in inner.initializer)
        defined.update(value.name for value in inner.input)
        defined.update(output for node in inner.node for output in node.output)
    defined -= {"", *contract.GREEDY_SEARCH.input_names()}
    rename = {value: _GREEDY_PREFIX + value for value in defined}
    beam_tensors = {}
    for tensor in beam_graph.initializer:
        beam_tensors.setdefault(_tensor_key(tensor), tensor.name)
    shared = [tensor for tensor in graph.initializer if _tensor_key(tensor) in beam_tensors]
    for tensor in shared:
        rename[tensor.name] = beam_tensors[_tensor_key(tensor)]
        graph.initializer.remove(tensor)
    for inner in _subgraphs(graph):
        for tensor in inner.initializer:
            tensor.name = rename.get(tensor.name, tensor.name)
        for value in (*inner.input, *inner.output, *inner.value_info):
            value.name = rename.get(value.name, value.name)
        for node in inner.node:
            if node.name:
                node.name = _GREEDY_PREFIX + node.name
            for names in (node.input, node.output):
                renamed = [rename.get(value, value) for value in names]
                del names[:]
                names.extend(renamed)
    return graph


class _Ragged(typing.NamedTuple):
    """Value names of the ragged pieces (`_tokenize_nodes`)."""

    pieces: str
    starts: str
    counts: str
    zero_1: str
    one_1: str


def _tokenize_nodes(graph, tokenizer_proto, text="text"):
    """Step 1: `text` [B] -> SentencePiece pieces, ragged.

    Returns:
        `_Ragged`: value names of the pieces `[N]` int32, each row's first
        piece and piece count `[B]` int64, and the int64 constants `[0]` and
        `[1]` that later steps reuse.
    """
    return _ragged_nodes(graph, *_sentencepiece_nodes(graph, tokenizer_proto, text))


def _sentencepiece_nodes(graph, tokenizer_proto, text):
    """`text` [B] -> `(pieces [N] int32, row_splits [B + 1] int64)`: SentencePiece ids, no start or end id."""
    false = graph.const("false", False, np.bool_)
    return graph.node(
        "SentencepieceTokenizer",
        [text, graph.const("nbest_size", 0, np.int64), graph.const("sampling_alpha", 0.0, np.float32),
         false, false, false],
        [graph.name("pieces"), graph.name("row_splits")],  # [N] int32, [B + 1] int64
        domain=EXTENSIONS_DOMAIN,
        model=tokenizer_proto,
    )


def _ragged_nodes(graph, pieces, splits):
    """`_Ragged` of ids `[N]` with row splits `[B + 1]`."""
    zero_1, one_1 = graph.const("zero_1", [0], np.int64), graph.const("one_1", [1], np.int64)
    starts = graph.node("Slice", [splits, zero_1, graph.const("minus_one_1", [-1], np.int64)], [graph.name("starts")])
    ends = graph.node(
        "Slice", [splits, one_1, graph.const("max_1", [np.iinfo(np.int64).max], np.int64)], [graph.name("ends")]
    )
    counts = graph.node("Sub", [ends, starts], [graph.name("counts")])  # [B]
    return _Ragged(pieces, starts, counts, zero_1, one_1)


class MarianSource(typing.NamedTuple):
    """`source.spm` as translate.onnx runs it, and how its ids become ours (`marian_source_model`)."""

    proto: bytes  # source.spm with the vocabulary's unknown-character pieces added
    our_ids: np.ndarray  # [P] int32: our id of each of its ids
    unknown: np.ndarray  # [P] bool: its unk id and the added ids
    added: tuple  # the added pieces


def marian_source_model(tokenizer):
    """The source model and tables with which SentencePiece ids give `MarianTokenizer.encode`'s ids.

    `MarianTokenizer` (as Hugging Face's) looks each piece up in vocab.json
    by its text, and SentencePiece returns a run of characters `source.spm`
    does not know as one piece: the run's text, with the unk id. The run is
    unk unless vocab.json has its text (a character only `target.spm`
    knows, such as "ß" under an English `source.spm`). The
    `SentencepieceTokenizer` operator returns ids, not texts, so:

    - every vocab.json entry made only of characters `source.spm` does not
      know is added to the model as a piece with the lowest score of its
      pieces. Known pieces never contain an unknown character, so an added
      piece can only match inside a run of unknown characters, and nothing
      else is cut differently; inside a run, one piece scores above any cut
      into two or more, so a run that is a vocab.json entry becomes that
      piece;
    - `unknown` marks the unk id and the added ids. In the graph, marked ids
      that follow each other are one run: a single added piece keeps its id
      (`our_ids`), any other run is one unk id (`_marian_ids_nodes`).

    Raises:
        ValueError: `source.spm` is not a unigram model but needs pieces added.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(tokenizer.source_proto)
    source = spm.SentencePieceProcessor(model_proto=tokenizer.source_proto)
    matched = (piece_type.NORMAL, piece_type.USER_DEFINED)  # the pieces SentencePiece matches in text
    known = {piece.piece for piece in model.pieces if piece.type in matched and len(piece.piece) == 1}
    added = [piece for piece in tokenizer.vocab if piece and not any(c in known for c in piece)]
    if added and model.trainer_spec.model_type != model.trainer_spec.UNIGRAM:
        raise ValueError(
            f"translate.onnx cannot tokenize as MarianTokenizer with this source.spm (a "
            f"{model.trainer_spec.ModelType.Name(model.trainer_spec.model_type)} model, not unigram, and vocab.json "
            f"has pieces it does not know, e.g. {added[0]!r}); translate with export.runtime.OnnxTranslator"
        )
    unknown_characters = {c for piece in added for c in piece}
    clash = [piece.piece for piece in model.pieces if piece.type in matched and unknown_characters & set(piece.piece)]
    if clash:  # SentencePiece trains no such piece; another tool might
        raise ValueError(
            f"translate.onnx cannot tokenize as MarianTokenizer with this source.spm: its piece {clash[0]!r} holds a "
            "character it has no piece of its own for; translate with export.runtime.OnnxTranslator"
        )
    lowest = min((piece.score for piece in model.pieces if piece.type == piece_type.NORMAL), default=0.0)
    size = len(model.pieces)
    for piece in added:
        model.pieces.add(piece=piece, score=lowest, type=piece_type.NORMAL)
    our_ids = np.array([tokenizer.id_of(piece.piece) for piece in model.pieces], np.int32)
    our_ids[source.unk_id()] = tokenizer.unk_id
    unknown = np.zeros(len(model.pieces), np.bool_)
    unknown[source.unk_id()] = True
    unknown[size:] = True
    return MarianSource(model.SerializeToString(), our_ids, unknown, tuple(added))


def marian_target_pieces(tokenizer):
    """`[V]` str: what each of our ids adds to the joined text in `MarianTokenizer.decode` ("" below the
    first ordinary id and for `target.spm`'s control pieces).

    Raises:
        ValueError: a piece is one of `target.spm`'s byte pieces (decoded to a
            byte, not joined as text).
    """
    import sentencepiece as spm

    target = spm.SentencePieceProcessor(model_proto=tokenizer.target_proto)
    texts = []
    for i, piece in enumerate(tokenizer.pieces()):
        target_id = target.piece_to_id(piece)
        if i < FIRST_ORDINARY_ID or (target.is_control(target_id) and target.id_to_piece(target_id) == piece):
            texts.append("")
        elif target.is_byte(target_id) and target.id_to_piece(target_id) == piece:
            raise ValueError(
                f"translate.onnx cannot decode as MarianTokenizer: {piece!r} is a byte piece of target.spm; "
                "translate with export.runtime.OnnxTranslator"
            )
        else:
            texts.append(piece)
    return texts


def check_text_graph_support(tokenizer, source, validate=True):
    """Raises (one line) unless `write_text_graph` can write translate.onnx for `tokenizer` (of `source`).

    `python -m export.onnx --with-tokenizer` asks before converting anything.

    Raises:
        FileNotFoundError: there is no tokenizer (`None`).
        ValueError: the graph cannot tokenize as `tokenizer` (`check_tokenizer`).
        ImportError: with `validate`, onnxruntime-extensions is not installed.
    """
    if tokenizer is None:
        raise FileNotFoundError(
            f"{source} has no {TOKENIZER_FILE} (nor an imported checkpoint's Marian tokenizer); export a preset "
            "directory or checkpoint that holds its tokenizer"
        )
    check_tokenizer(tokenizer)
    if validate:
        _require_extensions()


def check_tokenizer(tokenizer):
    """Raises `ValueError` (one line) when translate.onnx cannot tokenize and detokenize as `tokenizer`.

    Our shared `Tokenizer` always works. A `MarianTokenizer` does, but for a
    multilingual vocabulary (`>>xx<<` target-language codes): the graph
    cannot refuse a text without its code as `MarianTokenizer.encode` does.
    """
    if tokenizer.format != "marian":
        return
    if tokenizer.language_codes:
        raise ValueError(
            f"translate.onnx does not support this multilingual model ({len(tokenizer.language_codes)} "
            f"target-language codes such as {tokenizer.language_codes[0]!r}: the graph cannot check that each "
            "text starts with one); translate with export.runtime.OnnxTranslator(directory), which does"
        )
    marian_source_model(tokenizer)
    marian_target_pieces(tokenizer)


def _marian_tokenize_nodes(graph, tokenizer):
    """Step 1 for a `MarianTokenizer`: `text` [B] -> our ids, ragged, and which texts start with a code.

    As `MarianTokenizer.encode` (a vocabulary without language codes): a
    leading `>>xx<<` is one piece, outside the vocabulary (unk); the rest
    goes through `source.spm` (`marian_source_model`) and `_marian_ids_nodes`.

    Returns:
        `(_Ragged of our ids, leads)`: `leads` [B] int64, 1 where the text
        starts with a code (its unk id comes first), else 0.
    """
    from onnx import TensorProto

    name, node = graph.name, graph.node
    rest = node(
        "StringRegexReplace",
        ["text", graph.const("code_pattern", [LANGUAGE_CODE_RE2], object), graph.const("empty_1", [""], object)],
        [name("without_code")], domain=EXTENSIONS_DOMAIN,
    )
    text_length = node("StringLength", ["text"], [name("text_length")], domain=EXTENSIONS_DOMAIN)
    rest_length = node("StringLength", [rest], [name("rest_length")], domain=EXTENSIONS_DOMAIN)
    has_code = node("Less", [rest_length, text_length], [name("has_code")])
    leads = node("Cast", [has_code], [name("leads")], to=TensorProto.INT64)
    source = marian_source_model(tokenizer)
    pieces, splits = _sentencepiece_nodes(graph, source.proto, rest)
    ids, splits = _marian_ids_nodes(graph, pieces, splits, source, tokenizer.unk_id)
    return _ragged_nodes(graph, ids, splits), leads


def _marian_ids_nodes(graph, pieces, splits, source, unk_id):
    """SentencePiece ids `[N]` (rows by `splits`) -> our ids, each run of unknown-character ids made one id.

    A run is ids marked `source.unknown` that follow each other in a row: its
    first id stays, the others go; a run of one keeps its id (`our_ids`:
    an added piece's, or unk for SentencePiece's), a longer one is unk.

    Returns:
        `(ids [N'] int32, row_splits [B + 1] int64)`.
    """
    from onnx import TensorProto

    name, node = graph.name, graph.node
    n = node("Shape", [pieces], [name("n")])  # [1]
    n_plus_1 = node("Add", [n, graph.const("one_n", [1], np.int64)], [name("n_plus_1")])
    zero_1 = graph.const("zero_n", [0], np.int64)
    unknown = node("Gather", [graph.const("unknown_ids", source.unknown, np.bool_), pieces], [name("unknown")])
    # boundary[i]: a row starts at i (i = 0 .. N); empty rows repeat a split.
    zeros = node("Expand", [graph.const("zero_s", 0, np.int64), n_plus_1], [name("zeros")])
    ones = node("Expand", [graph.const("one_s", 1, np.int64), node("Shape", [splits], [name("splits_shape")])],
                [name("ones")])
    boundary = node("ScatterElements", [zeros, splits, ones], [name("boundary_int")], axis=0)
    boundary = node("Cast", [boundary], [name("boundary")], to=TensorProto.BOOL)
    row_start = node("Slice", [boundary, zero_1, n], [name("row_start")])  # [N]
    row_end = node("Slice", [boundary, graph.const("one_n_", [1], np.int64), n_plus_1], [name("row_end")])  # [N]
    false_1 = graph.const("false_1", [False], np.bool_)
    before = node("Slice", [node("Concat", [false_1, unknown], [name("unknown_shifted")], axis=0), zero_1, n],
                  [name("unknown_before")])
    after = node("Slice", [node("Concat", [unknown, false_1], [name("unknown_padded")], axis=0),
                           graph.const("one_a", [1], np.int64), n_plus_1], [name("unknown_after")])
    continues = node("And", [node("And", [unknown, before], [name("after_unknown")]),
                             node("Not", [row_start], [name("not_row_start")])], [name("continues_run")])
    longer = node("And", [node("And", [unknown, after], [name("before_unknown")]),
                          node("Not", [row_end], [name("not_row_end")])], [name("run_goes_on")])
    ours = node("Gather", [graph.const("our_ids", source.our_ids, np.int32), pieces], [name("our_ids_n")])
    ours = node("Where", [longer, graph.const("unk_id", unk_id, np.int32), ours], [name("our_ids_runs")])
    keep = node("Not", [continues], [name("keep_id")])
    ids = node("Compress", [ours, keep], [name("marian_ids")], axis=0)
    kept = node("CumSum", [node("Cast", [keep], [name("keep_int")], to=TensorProto.INT64),
                           graph.const("axis_0_k", 0, np.int64)], [name("kept_so_far")])
    kept = node("Concat", [graph.const("zero_k", [0], np.int64), kept], [name("kept_before")], axis=0)  # [N + 1]
    return ids, node("Gather", [kept, splits], [name("marian_splits")], axis=0)


def _pad_nodes(graph, ragged, pad_id, end_id, limit, leads=None, lead_id=None):
    """Step 2: ragged pieces -> `encoder_token_ids` [B', W] int32.

    The Translator's truncation: each row with pieces keeps at most
    `limit - 1` of them, then gets the end id, right-padded with `pad_id`.

    Args:
        graph: the `_GraphBuilder`.
        ragged: `_tokenize_nodes`' result.
        pad_id, end_id: ints from `config.json`.
        limit: `max_sequence_length`.
        leads: optional [B] int64, 0 or 1: whether `lead_id` comes before the
            row's pieces (a Marian language code), counted in the limit.

    Returns:
        The name of `has_pieces` [B] bool: which texts reach the search.
    """
    pieces, starts, counts, zero_1, one_1 = ragged
    name, node = graph.name, graph.node
    if leads is not None:
        counts = node("Add", [counts, leads], [name("counts_with_leads")])
    kept = node("Min", [counts, graph.const("max_pieces", limit - 1, np.int64)], [name("kept")])
    has_pieces = node("Greater", [counts, graph.const("zero", 0, np.int64)], [name("has_pieces")])  # [B]
    row_starts = node("Compress", [starts, has_pieces], [name("row_starts")], axis=0)  # [B']
    row_kept = node("Compress", [kept, has_pieces], [name("row_kept")], axis=0)  # [B']
    # Width: the longest kept row + the end id (the 0 keeps ReduceMax defined for B = 0).
    kept_or_0 = node("Concat", [kept, zero_1], [name("kept_or_0")], axis=0)  # [B + 1]
    longest = node("ReduceMax", [kept_or_0], [name("longest")], keepdims=0)
    width = node("Add", [longest, graph.const("one", 1, np.int64)], [name("width")])
    positions = node(
        "Range", [graph.const("zero_", 0, np.int64), width, graph.const("one_", 1, np.int64)], [name("positions")]
    )
    positions = node("Unsqueeze", [positions, zero_1], [name("positions_1w")])  # [1, W]
    row_kept = node("Unsqueeze", [row_kept, one_1], [name("row_kept_b1")])  # [B', 1]
    row_starts = node("Unsqueeze", [row_starts, one_1], [name("row_starts_b1")])  # [B', 1]
    is_piece = node("Less", [positions, row_kept], [name("is_piece")])  # [B', W]
    if leads is not None:
        row_leads = node("Compress", [leads, has_pieces], [name("row_leads")], axis=0)  # [B']
        row_leads = node("Unsqueeze", [row_leads, one_1], [name("row_leads_b1")])  # [B', 1]
        is_lead = node("Less", [positions, row_leads], [name("is_lead")])  # [B', W]
        is_piece = node("And", [is_piece, node("Not", [is_lead], [name("not_lead")])], [name("is_piece_after_lead")])
        row_starts = node("Sub", [row_starts, row_leads], [name("row_starts_before_lead")])
    # Index N (one past the pieces) reads an appended 0, the padding.
    total = node("Shape", [pieces], [name("total")])  # [1]
    offsets = node("Add", [row_starts, positions], [name("offsets")])  # [B', W]
    index = node("Where", [is_piece, offsets, total], [name("index")])
    padded_pieces = node(
        "Concat", [pieces, graph.const("pad_1", [pad_id], np.int32)], [name("padded_pieces")], axis=0
    )
    ids = node("Gather", [padded_pieces, index], [name("ids")], axis=0)  # [B', W]
    if leads is not None:
        ids = node("Where", [is_lead, graph.const("lead_id", lead_id, np.int32), ids], [name("ids_with_leads")])
    is_end = node("Equal", [positions, row_kept], [name("is_end")])
    node("Where", [is_end, graph.const("end_id", end_id, np.int32), ids], ["encoder_token_ids"])
    return has_pieces


def _search_nodes(graph, search, greedy):
    """Step 3: the search graphs' nodes in If nodes, run only when B' > 0.

    As `Translator` (`generation.generate`) chooses: the greedy search's
    nodes (`_greedy_graph`) when `beam_size` is 1, the beam search's
    otherwise (a beam search of one beam is not greedy search: it may end
    with a hypothesis it finished earlier). Their nodes read
    `encoder_token_ids`, `beam_size`, `alpha` and `max_extra_length` from
    this graph by name; their weights become this graph's initializers
    (`build_text_graph` adds them, still stored in weights.bin when the
    export put them there).

    Returns:
        The name of `sequences` [B', L] int32 ([0, 1] when B' = 0).
    """
    from onnx import TensorProto, helper, numpy_helper

    name, node = graph.name, graph.node
    rows = node("Shape", ["encoder_token_ids"], [name("ids_shape")])
    rows = node("Gather", [rows, graph.const("first_axis_1", [0], np.int64)], [name("rows")], axis=0)  # [1]
    any_rows = node("Greater", [rows, graph.const("zero_rows", [0], np.int64)], [name("any_rows")])
    is_greedy = node("Equal", ["beam_size", graph.const("one_beam", 1, np.int32)], [name("is_greedy")])
    run_beam = helper.make_graph(
        list(search.node), "beam_search", [], [helper.make_tensor_value_info("sequences", TensorProto.INT32, None)],
        value_info=list(search.value_info),
    )
    run_greedy = helper.make_graph(
        list(greedy.node), "greedy_search", [],
        [helper.make_tensor_value_info(_GREEDY_PREFIX + "sequences", TensorProto.INT32, None)],
        value_info=list(greedy.value_info),
    )
    choose = helper.make_node("If", [is_greedy], [name("searched")], name=name("searched"), then_branch=run_greedy,
                              else_branch=run_beam)
    run_search = helper.make_graph(
        [choose], "search", [], [helper.make_tensor_value_info(name("searched"), TensorProto.INT32, None)]
    )
    skip_search = helper.make_graph(
        [helper.make_node("Constant", [], [name("no_sequences")],
                          value=numpy_helper.from_array(np.zeros((0, 1), np.int32)))],
        "no_search", [], [helper.make_tensor_value_info(name("no_sequences"), TensorProto.INT32, None)],
    )
    return node("If", [any_rows], [name("sequences")], then_branch=run_search, else_branch=skip_search)


def _decode_row_graph(graph, sequences, row_of, tokenizer, pad_id, start_id, end_id):
    """The subgraph that decodes text `b`'s row of `sequences` into `decoded` [1] string.

    As `Tokenizer.decode`: the ids before the first end id, without
    padding and start ids, then `SentencepieceDecoder`. As
    `MarianTokenizer.decode`: the ids before the first end id, from the
    first ordinary id on, as their pieces (`marian_target_pieces`) joined,
    "▁" made a space and the ends stripped (`str.strip()`'s whitespace). It
    reads the Loop's counter `b` and `row_of` [B] (the row of text b among
    those with pieces).
    """
    from onnx import TensorProto, helper

    name, decode = graph.name, []

    def node(*args, **attributes):
        return graph.node(*args, into=decode, **attributes)

    row_b = node("Gather", [row_of, name("b")], [name("row_b")], axis=0)
    row = node("Gather", [sequences, row_b], [name("row")], axis=0)  # [L] int32
    row_is_end = node("Equal", [row, graph.const("end_i", end_id, np.int32)], [name("row_is_end")])
    row_is_end = node("Cast", [row_is_end], [name("row_is_end_int")], to=TensorProto.INT32)
    ends_so_far = node("CumSum", [row_is_end, graph.const("axis_0_", 0, np.int64)], [name("ends_so_far")])
    before_end = node("Equal", [ends_so_far, graph.const("zero_i", 0, np.int32)], [name("before_end")])
    if tokenizer.format == "marian":
        ordinary = node("GreaterOrEqual", [row, graph.const("first_ordinary_i", FIRST_ORDINARY_ID, np.int32)],
                        [name("row_is_ordinary")])
        keep = node("And", [before_end, ordinary], [name("row_keep")])
        tokens = node("Compress", [row, keep], [name("row_tokens")], axis=0)
        pieces = node("Gather", [graph.const("target_pieces", marian_target_pieces(tokenizer), object), tokens],
                      [name("row_pieces")], axis=0)
        joined = node("StringJoin", [pieces, graph.const("empty", "", object), graph.const("axis_0_j", 0, np.int64)],
                      [name("joined")], domain=EXTENSIONS_DOMAIN)  # [1] string
        spaced = node("StringRegexReplace", [joined, graph.const("underline", [SPIECE_UNDERLINE], object),
                                             graph.const("space", [" "], object)],
                      [name("spaced")], domain=EXTENSIONS_DOMAIN)
        ends = f"^{contract.WHITESPACE_RE2}+|{contract.WHITESPACE_RE2}+$"
        node("StringRegexReplace", [spaced, graph.const("strip_pattern", [ends], object),
                                    graph.const("empty_r", [""], object)],
             [name("decoded")], domain=EXTENSIONS_DOMAIN)  # [1] string
    else:
        is_pad = node("Equal", [row, graph.const("pad_i", pad_id, np.int32)], [name("row_is_pad")])
        is_start = node("Equal", [row, graph.const("start_i", start_id, np.int32)], [name("row_is_start")])
        special = node("Or", [is_pad, is_start], [name("row_is_special")])
        not_special = node("Not", [special], [name("row_not_special")])
        keep = node("And", [before_end, not_special], [name("row_keep")])
        tokens = node("Compress", [row, keep], [name("row_tokens")], axis=0)
        tokens = node("Cast", [tokens], [name("row_tokens_64")], to=TensorProto.INT64)
        node("SentencepieceDecoder", [tokens], [name("decoded")], domain=EXTENSIONS_DOMAIN,
             model=tokenizer.proto)  # [1] string
    return helper.make_graph(
        decode, "decode", [], [helper.make_tensor_value_info(name("decoded"), TensorProto.STRING, [1])]
    )


def _decode_nodes(graph, has_pieces, sequences, tokenizer, pad_id, start_id, end_id):
    """Step 4: a Loop over the batch -> `translation` [B] string, "" for texts without pieces."""
    from onnx import TensorProto, helper

    name, node = graph.name, graph.node
    has_pieces_int = node("Cast", [has_pieces], [name("has_pieces_int")], to=TensorProto.INT64)
    rows_so_far = node("CumSum", [has_pieces_int, graph.const("axis_0", 0, np.int64)], [name("rows_so_far")])
    row_of = node("Sub", [rows_so_far, graph.const("one_r", 1, np.int64)], [name("row_of")])  # [B]
    decode_row = _decode_row_graph(graph, sequences, row_of, tokenizer, pad_id, start_id, end_id)
    string_1 = helper.make_tensor_value_info
    no_text = helper.make_graph(
        [helper.make_node("Constant", [], [name("empty_text")],
                          value=helper.make_tensor("empty", TensorProto.STRING, [1], [b""]))],
        "empty", [], [string_1(name("empty_text"), TensorProto.STRING, [1])],
    )
    body_nodes = [
        helper.make_node("Gather", [has_pieces, name("b")], [name("text_has_pieces")], axis=0),
        helper.make_node("If", [name("text_has_pieces")], [name("text_b")], then_branch=decode_row,
                         else_branch=no_text),
        helper.make_node("Identity", [name("loop_condition")], [name("loop_condition_out")]),
    ]
    body = helper.make_graph(
        body_nodes, "decode_loop",
        [helper.make_tensor_value_info(name("b"), TensorProto.INT64, []),
         helper.make_tensor_value_info(name("loop_condition"), TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(name("loop_condition_out"), TensorProto.BOOL, []),
         string_1(name("text_b"), TensorProto.STRING, [1])],
    )
    batch = node("Squeeze", [node("Shape", ["text"], [name("batch_1")])], [name("batch")])
    texts = node("Loop", [batch, ""], [name("translations_b1")], body=body)  # [B, 1]
    node("Reshape", [texts, node("Shape", ["text"], [name("text_shape")])], ["translation"])


def _contract_values(default_values):
    """The graph's inputs, outputs and defaults, from `contract.TEXT_GRAPH`.

    Args:
        default_values: dict, optional input name -> its default.

    Returns:
        `(inputs, outputs, defaults)`: ValueInfoProtos (dynamic axes by name,
        `batch`) and one initializer per optional input, of the same name
        (ONNX's way of giving an input a default).
    """
    from onnx import helper, numpy_helper

    defaults = [
        numpy_helper.from_array(np.array(default_values[t.name], contract.numpy_dtype(t, None)), t.name)
        for t in contract.TEXT_GRAPH.inputs
        if t.name in contract.TEXT_GRAPH.optional
    ]

    def value_info(tensor):
        elem_type = helper.np_dtype_to_tensor_dtype(contract.numpy_dtype(tensor, None))
        return helper.make_tensor_value_info(tensor.name, elem_type, list(tensor.axes))

    inputs = [value_info(tensor) for tensor in contract.TEXT_GRAPH.inputs]
    outputs = [value_info(tensor) for tensor in contract.TEXT_GRAPH.outputs]
    return inputs, outputs, defaults


def _text_model(graph, search_model, default_values, greedy_model):
    """Wraps `graph` in a ModelProto: the searches' opsets and functions, ours, and the metadata."""
    from onnx import helper

    opsets = [o for o in search_model.opset_import if o.domain != EXTENSIONS_DOMAIN]
    model = helper.make_model(
        graph,
        opset_imports=opsets + [helper.make_opsetid(EXTENSIONS_DOMAIN, 1)],
        ir_version=search_model.ir_version,
        producer_name="keras_transformer export.text_graph",
        doc_string="Text in, text out: SentencePiece encoding, the beam search, SentencePiece decoding. "
        "Needs onnxruntime-extensions (register its library in the session options).",
    )
    model.functions.extend(search_model.functions)
    known = {(function.domain, function.name) for function in search_model.functions}
    model.functions.extend(f for f in greedy_model.functions if (f.domain, f.name) not in known)
    helper.set_model_props(model, {
        "keras_transformer.text_graph_version": str(TEXT_GRAPH_VERSION),
        "keras_transformer.defaults": json.dumps(default_values),
        "keras_transformer.needs": "onnxruntime-extensions (domain ai.onnx.contrib)",
    })
    return model


def _source_nodes(graph, tokenizer, config):
    """Steps 1 and 2 for either tokenizer: `text` -> `encoder_token_ids`; returns `has_pieces`."""
    limit = int(config["max_sequence_length"])
    pad_id, end_id = int(config["pad_id"]), int(config["end_id"])
    if tokenizer.format == "marian":
        ragged, leads = _marian_tokenize_nodes(graph, tokenizer)
        return _pad_nodes(graph, ragged, pad_id, end_id, limit, leads=leads, lead_id=int(config["unk_id"]))
    return _pad_nodes(graph, _tokenize_nodes(graph, tokenizer.proto), pad_id, end_id, limit)


def _decode_ids(config):
    return tuple(int(config[key]) for key in ("pad_id", "start_id", "end_id"))


def build_text_graph(search_model, tokenizer, config, beam_size=4, length_penalty=0.6, max_extra_length=50, *,
                     greedy_model):
    """The `translate.onnx` ModelProto around an exported beam search (and greedy search).

    The steps of the module docstring, in order: `_tokenize_nodes` (or
    `_marian_tokenize_nodes`), `_pad_nodes`, `_search_nodes`,
    `_decode_nodes`; the inputs, outputs and defaults come from
    `export/contract.py` (`_contract_values`).

    Args:
        search_model: `onnx.ModelProto` of `beam_search.onnx`.
        greedy_model: `onnx.ModelProto` of `greedy_search.onnx` (run for
            `beam_size` 1).
        tokenizer: the directory's tokenizer (`load_tokenizer`): a
            `Tokenizer` or a `MarianTokenizer` (`check_tokenizer`).
        config: dict, the directory's `config.json` (ids and
            `max_sequence_length`).
        beam_size, length_penalty, max_extra_length: the defaults of the
            optional inputs `beam_size`, `alpha` and `max_extra_length`.

    Returns:
        `onnx.ModelProto`.

    Raises:
        ValueError: a search graph is not a `beam_search.onnx` (or
            `greedy_search.onnx`) of this export format
            (`_check_search_graph`), or the graph cannot
            tokenize as `tokenizer` (`check_tokenizer`).
    """
    from onnx import helper

    check_tokenizer(tokenizer)
    search = search_model.graph
    _check_search_graph(search_model)
    _check_search_graph(greedy_model, contract.GREEDY_SEARCH, GREEDY_FILE)
    greedy = _greedy_graph(greedy_model, search)
    graph = _GraphBuilder()
    has_pieces = _source_nodes(graph, tokenizer, config)
    sequences = _search_nodes(graph, search, greedy)
    _decode_nodes(graph, has_pieces, sequences, tokenizer, *_decode_ids(config))
    default_values = {"beam_size": beam_size, "alpha": length_penalty, "max_extra_length": max_extra_length}
    inputs, outputs, defaults = _contract_values(default_values)
    text_graph = helper.make_graph(
        graph.nodes, "translate", inputs, outputs,
        initializer=defaults + graph.initializers + list(search.initializer) + list(greedy.initializer),
    )
    return _text_model(text_graph, search_model, default_values, greedy_model)


def build_tokenizer_graphs(tokenizer, config, opset=17):
    """translate.onnx's tokenizer steps alone, as two small models (to check them against the tokenizer).

    - `"encode"`: `text` [B] string -> `encoder_token_ids` [B', W] int32 (the
      rows of the texts with pieces, as the search receives them) and
      `has_pieces` [B] bool.
    - `"decode"`: `text` [B] string (only its length is read) and
      `sequences` [B, L] int32 -> `translation` [B] string.

    Returns:
        dict of `onnx.ModelProto` (they need onnxruntime-extensions).
    """
    from onnx import TensorProto, helper

    check_tokenizer(tokenizer)
    text = helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(EXTENSIONS_DOMAIN, 1)]
    graph = _GraphBuilder()
    has_pieces = _source_nodes(graph, tokenizer, config)
    graph.node("Identity", [has_pieces], ["has_pieces"])
    encode = helper.make_graph(graph.nodes, "encode", [text], [
        helper.make_tensor_value_info("encoder_token_ids", TensorProto.INT32, ["rows", "width"]),
        helper.make_tensor_value_info("has_pieces", TensorProto.BOOL, ["batch"]),
    ], initializer=graph.initializers)
    graph = _GraphBuilder()
    batch = graph.node("Shape", ["text"], [graph.name("text_shape_d")])
    every_text = graph.node("Expand", [graph.const("true", True, np.bool_), batch], [graph.name("every_text")])
    _decode_nodes(graph, every_text, "sequences", tokenizer, *_decode_ids(config))
    sequences = helper.make_tensor_value_info("sequences", TensorProto.INT32, ["batch", "length"])
    decode = helper.make_graph(graph.nodes, "decode", [text, sequences], [
        helper.make_tensor_value_info("translation", TensorProto.STRING, ["batch"]),
    ], initializer=graph.initializers)
    return {name: helper.make_model(g, opset_imports=opsets) for name, g in (("encode", encode), ("decode", decode))}


def _session(path):
    from export.runtime import _session_options, new_session

    extensions = _require_extensions()
    options = _session_options()
    options.register_custom_ops_library(extensions.get_library_path())
    return new_session(path, options, ["CPUExecutionProvider"])


def translate_texts(session, texts, **inputs):
    """Runs a `translate.onnx` session on a list of str; returns a list of str.

    `inputs`: optional `beam_size`, `alpha`, `max_extra_length` (Python numbers).
    """
    texts = np.array(list(texts), dtype=object).reshape(-1)
    translation = contract.run(session, contract.TEXT_GRAPH, {"text": texts, **inputs}, None)["translation"]
    return [text.decode("utf-8") if isinstance(text, bytes) else str(text) for text in translation]


def _child_main():
    """The child process of `translate_in_subprocess`: JSON request on stdin, JSON answer on stdout."""
    request = json.load(sys.stdin)
    directory = pathlib.Path(request["directory"])
    session = _session(directory / TEXT_GRAPH_FILE)
    answer = {"graph": [translate_texts(session, texts, **inputs) for texts, inputs in request["calls"]]}
    if request.get("compare"):
        from export.runtime import OnnxTranslator

        translator = OnnxTranslator(directory, providers=["CPUExecutionProvider"])
        # The graph's defaults for the inputs a call leaves out.
        defaults = json.loads(session.get_modelmeta().custom_metadata_map["keras_transformer.defaults"])
        answer["translator"] = [
            translator.translate(
                texts, **{_TRANSLATOR_NAMES[key]: value for key, value in {**defaults, **inputs}.items()}
            )
            for texts, inputs in request["calls"]
        ]
    json.dump(answer, sys.stdout)


# Graph input -> Translator.translate argument.
_TRANSLATOR_NAMES = {"beam_size": "beam_size", "alpha": "length_penalty", "max_extra_length": "max_extra_length"}


def translate_in_subprocess(directory, calls, compare=False, timeout=600):
    """Runs `translate.onnx` in a fresh Python process; returns its translations.

    onnxruntime-extensions' SentencePiece kernels crash the process (a
    segmentation fault while the session is created: two protobuf
    libraries) when TensorFlow was imported first (checked with
    onnxruntime-extensions 0.15.2 and TensorFlow 2.21), as it is during an
    export. A serving process has no TensorFlow; the export checks the graph
    in a child process that imports only onnxruntime, the extensions, NumPy
    and SentencePiece.

    Args:
        directory: the exported directory holding `translate.onnx`.
        calls: list of `(texts, inputs)`: a list of str and a dict of the
            optional graph inputs (`beam_size`, `alpha`, `max_extra_length`).
        compare: bool, also translate with `export.runtime.OnnxTranslator`
            (the same search arguments).

    Returns:
        `{"graph": [list of str per call]}`, with `"translator"` alongside
        when `compare` is true.
    """
    import os
    import subprocess

    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    request = {"directory": str(pathlib.Path(directory).resolve()), "calls": [list(c) for c in calls],
               "compare": compare}
    result = subprocess.run(
        [sys.executable, "-c", "from export.text_graph import _child_main; _child_main()"],
        input=json.dumps(request), capture_output=True, text=True, timeout=timeout, env=env, cwd=root,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"Running {TEXT_GRAPH_FILE} in a child process failed (exit status {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}"
        )
    return json.loads(result.stdout)


def _validation_texts(tokenizer, limit):
    """Sentences for the check after writing: empty ones, pieces of the vocabulary, non-ASCII, a long one.

    For a `MarianTokenizer`, also a text with a leading `>>xx<<` (one unk
    piece) and one with vocabulary pieces `source.spm` does not know.
    """
    first = FIRST_ORDINARY_ID
    pieces = [tokenizer.decode([[i]])[0] for i in range(first, min(tokenizer.vocabulary_size, first + 36))]
    words = [piece for piece in pieces if piece.strip()]
    texts = ["", "  ", " ".join(words[:3]), " ".join(words[3:12]) + ".", "Größe, ça, naïve, 東京."]
    if tokenizer.format == "marian":
        added = list(marian_source_model(tokenizer).added[:6])
        texts += [">>xx<< " + " ".join(words[:3]), " ".join(words[:2] + added) + " " + "".join(added)]
    if limit <= 64:  # A source cut at max_sequence_length (longer searches would be slow here).
        texts.append(" ".join(words * (limit // max(len(words), 1) + 2)))
    return texts


def validate_text_graph(directory, texts=None, beam_sizes=(1, 2), max_extra_length=5):
    """Checks that `translate.onnx` gives `OnnxTranslator`'s strings (in a child process).

    Args:
        directory: an exported directory holding `translate.onnx`.
        texts: list of str, or None for a few sentences built from the
            vocabulary (with empty ones, non-ASCII text and, when
            `max_sequence_length` <= 64, one to truncate).
        beam_sizes: the beam sizes to compare at.
        max_extra_length: int, kept small to keep the check fast.

    Raises:
        export.validate.ValidationError: naming the text, the beam size and
            both strings.
    """
    directory = pathlib.Path(directory)
    if texts is None:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        texts = _validation_texts(load_tokenizer(directory), int(config["max_sequence_length"]))
    calls = [(list(texts), {"beam_size": beam_size, "max_extra_length": max_extra_length}) for beam_size in beam_sizes]
    answer = translate_in_subprocess(directory, calls, compare=True)
    for (_, inputs), received, expected in zip(calls, answer["graph"], answer["translator"], strict=True):
        for text, got, want in zip(texts, received, expected, strict=True):
            if want != got:
                raise ValidationError(
                    f"{TEXT_GRAPH_FILE} translates {text!r} (beam_size={inputs['beam_size']}) as {got!r}; "
                    f"OnnxTranslator gives {want!r}"
                )
    logger.info("Validated %s on %d texts against OnnxTranslator", TEXT_GRAPH_FILE, len(texts))


def write_text_graph(directory, beam_size=4, length_penalty=0.6, max_extra_length=50, validate=True):
    """Writes `translate.onnx` (text in, text out) into an exported ONNX directory.

    Args:
        directory: written by `python -m export.onnx` from a preset with a
            tokenizer (it holds `beam_search.onnx`, `config.json` and
            `tokenizer.model`, or an imported checkpoint's Marian tokenizer
            files).
        beam_size: int >= 1, default of the graph's `beam_size` input.
        length_penalty: float >= 0, default of its `alpha` input.
        max_extra_length: int >= 0, default of its `max_extra_length` input.
        validate: bool, compare the graph's strings with `OnnxTranslator`'s
            afterwards (`validate_text_graph`); a mismatch removes the file.

    Returns:
        `pathlib.Path` of `translate.onnx`.

    Raises:
        FileNotFoundError: the directory lacks one of the files above.
        ValueError: the graph cannot tokenize as the directory's tokenizer
            (`check_tokenizer`: a multilingual Marian vocabulary).
        ImportError: onnxruntime-extensions is not installed (validation).
        export.validate.ValidationError: the graph's strings differ.
    """
    import onnx

    from keras_transformer.decoding import check_search_args

    check_search_args(beam_size, length_penalty, max_extra_length)
    directory = pathlib.Path(directory)
    for file in (CONFIG_FILE, SEARCH_FILE, GREEDY_FILE):
        if not (directory / file).is_file():
            raise FileNotFoundError(f"{directory} has no {file}; expected a directory written by "
                                    f"`python -m export.onnx`")
    tokenizer = load_tokenizer(directory)
    check_text_graph_support(tokenizer, directory, validate=validate)
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    model = build_text_graph(
        # Weights stay where they are: in `weights.bin` (or the graph), shared with the other graphs.
        onnx.load(str(directory / SEARCH_FILE), load_external_data=False),
        tokenizer,
        config,
        greedy_model=onnx.load(str(directory / GREEDY_FILE), load_external_data=False),
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_extra_length=max_extra_length,
    )
    path = directory / TEXT_GRAPH_FILE
    temporary = path.with_name(path.name + ".partial")
    onnx.save(model, str(temporary))
    try:
        # Checked from its file: the weights it names in weights.bin are read from beside it.
        onnx.checker.check_model(str(temporary))
        temporary.replace(path)
        if validate:
            validate_text_graph(directory)
    except BaseException:
        temporary.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise
    logger.info("Wrote %s", path)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.text_graph",
        description=f"Add {TEXT_GRAPH_FILE} (string text -> string translation, SentencePiece and the beam "
        "search in one ONNX graph; needs onnxruntime-extensions) to a directory written by `python -m export.onnx`.",
    )
    parser.add_argument("--model", required=True, help="directory written by `python -m export.onnx`")
    parser.add_argument("--beam-size", type=int, default=4, help="default of the beam_size input (default 4)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="default of the alpha input (default 0.6)")
    parser.add_argument("--max-extra-length", type=int, default=50,
                        help="default of the max_extra_length input (default 50)")
    parser.add_argument("--no-validate", action="store_true", help="skip the comparison with OnnxTranslator")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("export").setLevel(logging.INFO)
    try:
        write_text_graph(args.model, beam_size=args.beam_size, length_penalty=args.length_penalty,
                         max_extra_length=args.max_extra_length, validate=not args.no_validate)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
