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

This module writes the graph into an export, checks it against
`OnnxTranslator` in a child process (`validate_text_graph`) and is the
command. The graph itself is built by `export/text_graph_builder.py`
(`build_text_graph`: the search graphs and the inputs and outputs) from the
tokenizer steps (1, 2 and 4 below) of `export/text_graph_tokenizer.py`.

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
does in Python (`translator.py`, `tokenizers/`):

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

import numpy as np

from export import contract
from export.contract import CONFIG_FILE, ValidationError
# The graph is built in `text_graph_builder` from the steps of
# `text_graph_tokenizer`; their names stay importable from here (plain
# re-exports). `write_text_graph` calls `build_text_graph` through this
# module, where tests patch it.
from export.text_graph_builder import (  # noqa: F401 - some re-exported
    GREEDY_FILE, SEARCH_FILE, build_text_graph, build_tokenizer_graphs,
)
from export.text_graph_tokenizer import (  # noqa: F401 - some re-exported
    LANGUAGE_CODE_RE2, check_tokenizer, marian_source_model, marian_target_pieces,
)
from keras_transformer import cli
from keras_transformer.tokenizers.sentencepiece import FIRST_ORDINARY_ID, load_tokenizer
from keras_transformer.tokenizers.sentencepiece import TOKENIZER_FILENAME as TOKENIZER_FILE

logger = logging.getLogger("export.text_graph")

TEXT_GRAPH_FILE = "translate.onnx"


def _require_extensions():
    try:
        import onnxruntime_extensions
    except ImportError:
        raise ImportError(
            "translate.onnx needs onnxruntime-extensions (SentencePiece operators): "
            "pip install onnxruntime-extensions"
        ) from None
    return onnxruntime_extensions


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
    if not tokenizer.sentencepiece_ids:  # a Marian vocabulary (check_tokenizer refuses the other kinds)
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
    cli.setup_logging()
    logging.getLogger("export").setLevel(logging.INFO)
    try:
        write_text_graph(args.model, beam_size=args.beam_size, length_penalty=args.length_penalty,
                         max_extra_length=args.max_extra_length, validate=not args.no_validate)
    except (FileNotFoundError, ValueError, ImportError) as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
