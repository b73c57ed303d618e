"""ONNX Runtime inference for a directory written by `python -m export.onnx`.

`OnnxSeq2Seq` implements the decoding protocol of
`keras_transformer.generation` (`encode`, `init_cache`, `decode_step` and the
id attributes) with ONNX Runtime sessions, so the one search that drives the
Keras model drives these graphs too and gives the same tokens.
`OnnxTranslator` adds the tokenizer stored in the directory: text in, text
out, without TensorFlow graphs or Keras weights.

Example:

```python
from export.runtime import OnnxSeq2Seq, OnnxTranslator

model = OnnxSeq2Seq("exported/onnx")        # CUDA when available, else CPU (logged)
ids = model.generate(src_ids, beam_size=4)  # same tokens as TransformerModel.generate
OnnxTranslator("exported/onnx").translate(["A sentence."])
```

```
echo "A sentence." | python -m export.runtime --model exported/onnx --beam-size 4
```
"""

import argparse
import json
import logging
import pathlib
import sys

import numpy as np

from keras_transformer.translate import read_lines
from keras_transformer.translator import Translator

from export.validate import (
    BEAM_REORDERED_KEYS,
    CACHE_KEYS,
    CONFIG_FILE,
    FORMAT_VERSION,
    GRAPHS,
    ValidationError,
    check_graph_signature,
)

# Named, not __name__, so that `python -m export.runtime` logs under the same name.
logger = logging.getLogger("export.runtime")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def read_config(directory):
    """The `config.json` of an exported directory, after checking that every file is there.

    Raises:
        FileNotFoundError: the directory, its config or a graph is missing.
        ValueError: the directory is from another format version.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"No ONNX model directory at {str(directory)!r}")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {CONFIG_FILE}; expected a directory written by `python -m export.onnx`"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from None
    version = config.get("format_version") if isinstance(config, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{config_path} has format_version={version!r}; this version of export.runtime reads "
            f"format {FORMAT_VERSION}. Export the model again with this version of export.onnx."
        )
    for graph in GRAPHS:
        path = directory / config["graphs"][graph]
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is missing {path.name} (the {graph} graph)")
    return config


def resolve_providers(providers=None):
    """ONNX Runtime execution providers: CUDA first when available, else CPU (with a warning)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if providers is not None:
        providers = list(providers)
        names = [p[0] if isinstance(p, (tuple, list)) else p for p in providers]
        missing = [name for name in names if name not in available]
        if missing:
            raise ValueError(
                f"Execution provider(s) {missing} are not available; this onnxruntime has {available}"
            )
        return providers
    if CUDA in available:
        return [CUDA, CPU]
    logger.warning(
        "CUDAExecutionProvider is not available (onnxruntime %s has %s); running on the CPU. "
        "Install onnxruntime-gpu with CUDA for GPU inference.",
        ort.__version__,
        available,
    )
    return [CPU]


def _session_options():
    """ONNX Runtime session options for step-by-step decoding.

    Python runs between two graph calls of the search; ONNX Runtime's
    intra-op threads spin-wait for work by default and then compete with it
    for the cores. Without spinning, generation with the `small` preset ran
    about twice as fast on a 2-core CPU (measured with the earlier search
    loop, which ran TensorFlow between the steps; with the search in ONNX
    Runtime, spinning on two threads was still 2x slower, see
    benchmarks/README.md); it does not change the CUDA execution provider.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _to_numpy(x):
    """A NumPy array from a NumPy array, list, or backend tensor (no copy when already NumPy)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple, int, float, np.generic)):
        return np.asarray(x)
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x))


def _check_ids(token_ids, name, rank, vocabulary_size):
    """Checks rank, integer dtype and id range; returns int32 ids."""
    ids = _to_numpy(token_ids)
    if ids.ndim != rank:
        expected = "[batch, length]" if rank == 2 else "[batch]"
        raise ValueError(f"{name} must have rank {rank} {expected}, received shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of token ids, received dtype {ids.dtype}")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocabulary_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name} contains token id {bad}, outside [0, {vocabulary_size}) for "
                f"vocabulary_size={vocabulary_size}. Check that the tokenizer and the model "
                "use the same vocabulary."
            )
    return ids.astype(np.int32, copy=False)


class OnnxSeq2Seq:
    """An exported TransformerModel on ONNX Runtime, with the decoding protocol.

    Args:
        directory: written by `python -m export.onnx` (`export_onnx`).
        providers: ONNX Runtime execution providers; `None` uses
            `CUDAExecutionProvider` when available and falls back to the CPU
            with a logged warning.
        use_io_binding: bool or None. Run through ONNX Runtime I/O binding,
            keeping the last cache tensors on the device so that a cache
            entry passed back unchanged (the cross-attention cache every
            step, and the self-attention cache in greedy search) is not
            copied to the device again. `None`: only under CUDA.
        session_options: optional `onnxruntime.SessionOptions` for the
            graphs' sessions; the default turns off the CPU thread pool's spinning
            (see `_session_options`).

    Attributes: `vocabulary_size`, `pad_id`, `unk_id`, `start_id`, `end_id`,
    `max_sequence_length`, `config` (the directory's `config.json`),
    `providers` (those the sessions run with).

    Example:
    >>> model = OnnxSeq2Seq("exported/onnx")
    >>> model.generate(np.array([[5, 6, 7, 3]]), beam_size=4)[0, 0]
    2
    """

    def __init__(self, directory, providers=None, use_io_binding=None, session_options=None):
        import onnxruntime as ort

        self.directory = pathlib.Path(directory)
        self.config = read_config(self.directory)
        config = self.config
        self.vocabulary_size = int(config["vocabulary_size"])
        self.pad_id, self.unk_id = int(config["pad_id"]), int(config["unk_id"])
        self.start_id, self.end_id = int(config["start_id"]), int(config["end_id"])
        self.max_sequence_length = int(config["max_sequence_length"])
        self.hidden_dim = int(config["hidden_dim"])
        self._cache_dtype = np.dtype(config["cache_dtype"])

        requested = resolve_providers(providers)
        self._sessions = {}
        for graph in GRAPHS:
            path = self.directory / config["graphs"][graph]
            try:
                session = ort.InferenceSession(
                    str(path), session_options or _session_options(), providers=requested
                )
            except Exception as error:  # noqa: BLE001 - re-raised naming the file
                raise ValueError(f"ONNX Runtime could not load {path}: {error}") from error
            try:
                check_graph_signature(session, graph)
            except ValidationError as error:
                raise ValueError(f"{path} does not match export format {FORMAT_VERSION}: {error}") from None
            self._sessions[graph] = session
        self.providers = self._sessions["decoder_step"].get_providers()
        wanted = requested[0][0] if isinstance(requested[0], (tuple, list)) else requested[0]
        if wanted == CUDA and self.providers[0] != CUDA:
            logger.warning(
                "CUDAExecutionProvider could not be initialised (check the CUDA and cuDNN libraries); "
                "running on %s",
                self.providers,
            )
        self._device = "cuda" if self.providers[0] == CUDA else "cpu"
        self.use_io_binding = self._device == "cuda" if use_io_binding is None else bool(use_io_binding)
        # Graph input name -> (host array, the OrtValue made from it).
        self._device_values = {}

    def __repr__(self):
        return f"OnnxSeq2Seq({str(self.directory)!r}, providers={self.providers})"

    # ------------------------------------------------------------------ #
    # Running a graph
    # ------------------------------------------------------------------ #
    def _device_value(self, name, array):
        """The OrtValue on the device for `array`, reusing the last one for the same array."""
        import onnxruntime as ort

        cached = self._device_values.get(name)
        # Only read-only arrays (the outputs `_run` hands out) are reused:
        # a writable one may have changed since it was copied.
        if cached is not None and cached[0] is array and not array.flags.writeable:
            return cached[1]
        # (Not np.ascontiguousarray: it turns the scalar `step` into shape [1].)
        array_c = array if array.flags.c_contiguous else array.copy(order="C")
        value = ort.OrtValue.ortvalue_from_numpy(array_c, self._device, 0)
        self._device_values[name] = (array, value)
        return value

    def _run(self, graph, feeds, output_names, keep_on_device=()):
        """Runs one graph; returns NumPy outputs in the order of `output_names`.

        With I/O binding, inputs go through `_device_value`, and the outputs
        named in `keep_on_device` (`output name -> input name` it will be fed
        back as) are remembered on the device for the next call. The host
        copies handed out are read-only, so an array passed back by identity
        is known to hold the same values as its device copy.
        """
        session = self._sessions[graph]
        if not self.use_io_binding:
            return session.run(output_names, feeds)
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, self._device_value(name, array))
        for name in output_names:
            binding.bind_output(name, self._device, 0)
        session.run_with_iobinding(binding)
        results = []
        for name, value in zip(output_names, binding.get_outputs()):
            array = value.numpy()
            array.flags.writeable = False
            if name in keep_on_device:
                self._device_values[keep_on_device[name]] = (array, value)
            results.append(array)
        return results

    # ------------------------------------------------------------------ #
    # The decoding protocol
    # ------------------------------------------------------------------ #
    def _check_length(self, length, what):
        if length > self.max_sequence_length:
            raise ValueError(
                f"{what} of length {length} is longer than max_sequence_length="
                f"{self.max_sequence_length} of the exported model; use shorter inputs."
            )

    def encode(self, encoder_token_ids):
        """Encoder outputs `[B, S, D]` (float32 NumPy) for source ids `[B, S]`."""
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.vocabulary_size)
        self._check_length(ids.shape[1], "encoder_token_ids")
        (outputs,) = self._run("encoder", {"encoder_token_ids": ids}, ["encoder_outputs"])
        return outputs

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        """The decoding cache for `max_length` target positions (as `TransformerModel.init_cache`).

        Returns:
            dict of NumPy arrays: `self_key [B, L, N, T_max, K]`,
            `self_value [B, L, N, T_max, Vh]`, `cross_key [B, L, N, S, K]`,
            `cross_value [B, L, N, S, Vh]`, `encoder_padding_mask [B, S]` bool.
        """
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.vocabulary_size)
        outputs = _to_numpy(encoder_outputs)
        if outputs.ndim != 3 or outputs.shape[-1] != self.hidden_dim or outputs.shape[:2] != ids.shape:
            raise ValueError(
                f"encoder_outputs must have shape [batch, source_length, {self.hidden_dim}] matching "
                f"encoder_token_ids {ids.shape}, received {outputs.shape}"
            )
        if outputs.dtype.kind != "f":
            raise ValueError(f"encoder_outputs must be floating point, received dtype {outputs.dtype}")
        if isinstance(max_length, bool) or int(max_length) != max_length or max_length < 1:
            raise ValueError(f"max_length={max_length!r} must be a positive integer")
        feeds = {
            "encoder_outputs": outputs.astype(self._cache_dtype, copy=False),
            "encoder_token_ids": ids,
            "max_length": np.array(int(max_length), np.int32),
        }
        # Every entry is fed back to decoder_step under its own name.
        outputs = self._run("init_cache", feeds, list(CACHE_KEYS), keep_on_device={n: n for n in CACHE_KEYS})
        return dict(zip(CACHE_KEYS, outputs))

    def decode_step(self, token_ids, index, cache):
        """One cached decoder step (as `TransformerModel.decode_step`).

        Args:
            token_ids: int `[B]` (or `[B, 1]`), the tokens at position `index`.
            index: int (or scalar integer array), their position.
            cache: from `init_cache` or the previous step.

        Returns:
            `(logits [B, V] float32, updated cache)`.
        """
        ids = _to_numpy(token_ids)
        if ids.ndim == 2 and ids.shape[1] == 1:
            ids = ids[:, 0]
        ids = _check_ids(ids, "token_ids", 1, self.vocabulary_size)
        index_array = _to_numpy(index)
        if index_array.ndim != 0 or index_array.dtype.kind not in "iu":
            raise ValueError(f"index must be a scalar integer, received {index!r}")
        index = int(index_array)
        if not isinstance(cache, dict) or set(CACHE_KEYS) - set(cache):
            received = sorted(cache) if isinstance(cache, dict) else type(cache).__name__
            raise ValueError(
                f"cache must be the dict from init_cache with keys {list(CACHE_KEYS)}, received {received}"
            )
        feeds = {name: _to_numpy(cache[name]) for name in CACHE_KEYS}
        batches = {name: value.shape[0] for name, value in feeds.items()}
        if any(batch != ids.shape[0] for batch in batches.values()):
            raise ValueError(f"token_ids has batch {ids.shape[0]} but the cache entries have batches {batches}")
        cache_length = feeds["self_key"].shape[3]
        if not 0 <= index < cache_length:
            raise ValueError(
                f"index={index} is outside the cache of length {cache_length} (init_cache max_length)"
            )
        self._check_length(index + 1, "The decoded sequence")
        feeds["decoder_token_ids"] = ids
        feeds["step"] = np.array(index, np.int32)
        logits, self_key, self_value = self._run(
            "decoder_step",
            feeds,
            ["logits", "updated_self_key", "updated_self_value"],
            keep_on_device={"updated_self_key": "self_key", "updated_self_value": "self_value"},
        )
        return logits, dict(cache, self_key=self_key, self_value=self_value)

    def run_search(self, encoder_token_ids, max_lengths, alpha, beam_size, length):
        """The search loop of `generation.generate`, every step in ONNX Runtime.

        Per step, two graphs: `decoder_step` (the model) and `greedy_update`
        or `beam_update`, which is `generation.search_step` exported (the
        search's log-softmax, top-k, bookkeeping and stopping test, and for
        beams the reordering of the self-attention cache), so the tokens are
        those of the Keras search. NumPy arrays (or device values under I/O
        binding) pass from one graph to the next; no TensorFlow, JAX or
        Python work per step beyond the two calls. Called by `generate`
        (`generation.generate`) with the padded source and the lengths.

        Returns:
            `(sequences [B, L] int32, scores [B] float32)`, NumPy.
        """
        from keras_transformer import generation

        source = _to_numpy(encoder_token_ids).astype(np.int32, copy=False)
        name, state, cache = generation.initial_search_state(self, source, int(beam_size), int(length))
        state = {key: _to_numpy(value) for key, value in state.items()}
        state["index"] = state["index"].astype(np.int32)
        cache = {key: _to_numpy(value) for key, value in cache.items()}
        tokens = _to_numpy(generation.search_tokens(name, state)).astype(np.int32, copy=False)
        constants = {
            "max_lengths": _to_numpy(max_lengths).astype(np.int32, copy=False),
            "alpha": np.array(_to_numpy(alpha), np.float32),
            "length": np.array(int(length), np.int32),
        }
        graph = f"{name}_update"
        state_keys = generation.SEARCH_STATE_KEYS[name]
        reordered = BEAM_REORDERED_KEYS if name == "beam" else ()
        outputs = [f"updated_{key}" for key in state_keys + reordered] + ["tokens", "keep_going"]
        # Cache entries go from one graph to the next under their input names.
        step_kept = {"updated_self_key": "self_key", "updated_self_value": "self_value"}
        update_kept = {f"updated_{key}": key for key in reordered}
        keep_going = True
        while keep_going:
            logits, cache["self_key"], cache["self_value"] = self._run(
                "decoder_step",
                {"decoder_token_ids": tokens, "step": state["index"], **cache},
                ["logits", "updated_self_key", "updated_self_value"],
                keep_on_device=step_kept,
            )
            feeds = {**state, "logits": logits, **constants, **{key: cache[key] for key in reordered}}
            results = dict(zip(outputs, self._run(graph, feeds, outputs, keep_on_device=update_kept)))
            state = {key: results[f"updated_{key}"] for key in state_keys}
            cache.update({key: results[f"updated_{key}"] for key in reordered})
            tokens, keep_going = results["tokens"], bool(results["keep_going"])
        sequences, scores = generation.search_result(name, state)
        return _to_numpy(sequences), _to_numpy(scores)

    def generate(self, encoder_token_ids, beam_size=4, length_penalty=0.6, max_extra_length=50):
        """Greedy (`beam_size=1`) or beam search with `keras_transformer.generation.generate`.

        The same search as `TransformerModel.generate`, run by ONNX Runtime
        step by step (`run_search`).

        Returns:
            int32 NumPy array `[B, L]`: start id, tokens, end id, then 0s.
        """
        from keras_transformer.generation import generate

        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.vocabulary_size)
        return generate(
            self,
            ids,
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_extra_length=max_extra_length,
        )


class OnnxTranslator(Translator):
    """Text in, text out with an exported model and the tokenizer stored beside it.

    The Keras `Translator` (same tokenization, length-sorted batches,
    truncation, empty lines, progress bar) over an `OnnxSeq2Seq`; the search
    runs in ONNX Runtime (`OnnxSeq2Seq.run_search`).

    Args:
        directory: written by `python -m export.onnx` from a preset with a
            tokenizer.
        providers: as `OnnxSeq2Seq`.

    Example:
    >>> OnnxTranslator("exported/onnx").translate(["A sentence."], beam_size=4)
    ['Ein Satz.']
    """

    def __init__(self, directory, providers=None):
        from keras_transformer.tokenizer import TOKENIZER_FILENAME, Tokenizer

        directory = pathlib.Path(directory)
        read_config(directory)
        if not (directory / TOKENIZER_FILENAME).is_file():
            raise FileNotFoundError(
                f"{directory} has no {TOKENIZER_FILENAME}; export a preset directory that holds "
                "its tokenizer to translate text (OnnxSeq2Seq works on ids without one)"
            )
        super().__init__(OnnxSeq2Seq(directory, providers=providers), Tokenizer.load(directory))

    @classmethod
    def from_preset(cls, directory, providers=None):
        """`OnnxTranslator(directory)`, named as `Translator.from_preset`."""
        return cls(directory, providers=providers)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.runtime",
        description="Translate stdin to stdout, one sentence per line, with an exported ONNX model.",
    )
    parser.add_argument("--model", required=True, help="directory written by `python -m export.onnx`")
    parser.add_argument("--beam-size", type=int, default=4, help="beam size; 1 is greedy (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per search (default 32)")
    parser.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha (default 0.6)")
    parser.add_argument(
        "--max-extra-length", type=int, default=50, help="output tokens beyond the source length (default 50)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        translator = OnnxTranslator(args.model)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(1, f"error: {error}\n")
    # Empty lines translate to empty lines, so the output lines up with the input.
    translations = translator.translate(
        read_lines(None),
        beam_size=args.beam_size,
        batch_size=args.batch_size,
        length_penalty=args.length_penalty,
        max_extra_length=args.max_extra_length,
    )
    for text in translations:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
