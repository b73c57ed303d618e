"""translate.onnx's tokenizer steps: the nodes that turn text into ids (steps 1 and 2) and ids into text (step 4).

For our shared `Tokenizer` (SentencePiece's operators of
onnxruntime-extensions) and for an imported `MarianTokenizer` (its
`source.spm` with the vocabulary's unknown pieces added, and our ids as its
pieces on the way out); `check_tokenizer` says which tokenizers the graph
can follow. The nodes go into `export.text_graph_builder._GraphBuilder`; the
steps are described in `export/text_graph.py`.
"""

import typing

import numpy as np

from export import contract
from keras_transformer.tokenizers.marian import SPIECE_UNDERLINE
from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID

# The custom-op domain of onnxruntime-extensions.
EXTENSIONS_DOMAIN = "ai.onnx.contrib"
# A leading `>>xx<<` target-language token, as `marian_tokenizer.split_language_code` finds it.
LANGUAGE_CODE_RE2 = r"^>>(?s:.*?)<<"


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


def check_tokenizer(tokenizer):
    """Raises `ValueError` (one line) when translate.onnx cannot tokenize and detokenize as `tokenizer`.

    Our shared `Tokenizer` always works. A `MarianTokenizer` does, but for a
    multilingual vocabulary (`>>xx<<` target-language codes): the graph
    cannot refuse a text without its code as `MarianTokenizer.encode` does.
    A tokenizer whose languages are named per call (`with_languages`: an
    imported NLLB-200 checkpoint's) does not: the graph has no language inputs.
    """
    if hasattr(tokenizer, "with_languages"):
        raise ValueError(
            f"translate.onnx does not support this multilingual model ({len(tokenizer.language_codes)} language "
            "codes named per call; the graph has no source_language / target_language inputs); translate with "
            "export.runtime.OnnxTranslator(directory).translate(texts, source_language=..., target_language=...)"
        )
    if tokenizer.sentencepiece_ids:
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
    if not tokenizer.sentencepiece_ids:  # a Marian vocabulary (`check_tokenizer`)
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


def _source_nodes(graph, tokenizer, config):
    """Steps 1 and 2 for either tokenizer: `text` -> `encoder_token_ids`; returns `has_pieces`."""
    limit = int(config["max_sequence_length"])
    pad_id, end_id = int(config["pad_id"]), int(config["end_id"])
    if not tokenizer.sentencepiece_ids:  # a Marian vocabulary (`check_tokenizer`)
        ragged, leads = _marian_tokenize_nodes(graph, tokenizer)
        return _pad_nodes(graph, ragged, pad_id, end_id, limit, leads=leads, lead_id=int(config["unk_id"]))
    return _pad_nodes(graph, _tokenize_nodes(graph, tokenizer.proto), pad_id, end_id, limit)


def _decode_ids(config):
    return tuple(int(config[key]) for key in ("pad_id", "start_id", "end_id"))
