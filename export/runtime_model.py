"""`OnnxSeq2Seq`: the decoding protocol and the search on ONNX Runtime, for a directory of `python -m export.onnx`.

No training framework is imported (see `export.runtime`). `generate` and
`generate_hypotheses` run the Keras search itself, converted: the exported
`<search>_start` graph once, then per step the fused decoder step and the
`<search>_update` graph from a Python loop (`export.steps`), or with
`driver="whole"` the whole-search graphs in one call.
"""

import logging
import pathlib

import numpy as np

from export import contract
from export.contract import CONFIG_FILE, ValidationError, check_graph_signature
from export.runtime_sessions import (
    CACHE_KEYS, CUDA, OptimizedGraphCache, _session_options, new_session, read_config, resolve_providers,
)
from export.steps import DRIVERS, step_search
from keras_transformer.decoding import collect_hypotheses, finish_rows, no_hypotheses, target_prefix_ids
from keras_transformer.search.options import BEAM, call_options, refuse_hypotheses
from keras_transformer.token_ids import check_id_range

# Named, not __name__: the runtime's messages keep the name they had in `export.runtime`.
logger = logging.getLogger("export.runtime")


def _to_numpy(x):
    """A NumPy array from a NumPy array, list, number, or a CPU tensor of any framework."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy") and not isinstance(x, (list, tuple)):
        x = x.numpy()  # TensorFlow eager tensors and CPU torch tensors.
    return np.asarray(x)


def _check_ids(token_ids, name, rank, vocabulary_size):
    """Checks rank, integer dtype and id range; returns int32 ids."""
    ids = _to_numpy(token_ids)
    if ids.ndim != rank:
        expected = "[batch, length]" if rank == 2 else "[batch]"
        raise ValueError(f"{name} must have rank {rank} {expected}, received shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array of token ids, received dtype {ids.dtype}")
    check_id_range(ids, name, vocabulary_size)
    return ids.astype(np.int32, copy=False)


class OnnxSeq2Seq(OptimizedGraphCache):
    """An exported TransformerModel on ONNX Runtime.

    `generate` runs a whole search per call (the exported `greedy_search` or
    `beam_search` graph); `encode`, `init_cache` and `decode_step` implement
    the decoding protocol of `keras_transformer.generation` with the
    protocol graphs. Sessions are created on first use, so a server that
    only translates loads one graph.

    Args:
        directory: written by `python -m export.onnx` (`export_onnx`).
        providers: ONNX Runtime execution providers; `None` uses
            `CUDAExecutionProvider` when it works on this machine (tried
            once, quietly) and the CPU otherwise.
        use_io_binding: bool or None. For the protocol methods
            (`decode_step` step by step): run through ONNX Runtime I/O
            binding, keeping the last cache tensors on the device so that a
            cache entry passed back unchanged is not copied to the device
            again. `None`: only under CUDA. (`generate` keeps its caches
            inside one call, on the device, anyway.)
        session_options: optional `onnxruntime.SessionOptions`; the default
            turns off the thread pool's spinning (see `_session_options`).
        intra_op_threads: int or None, threads per session (with the
            default session options).
        optimized_cache: optional directory. Each graph's session, once
            ONNX Runtime has optimised the graph, is saved there (with its
            weights) and later sessions load that copy without optimising
            again (the step driver's three sessions start in about 0.06 s
            of CPU instead of 0.08 s for `small`; benchmarks/README.md). The
            copy is named after the graph file's path, the graph and weights
            files (size, time), onnxruntime's version, the providers and the
            optimisation level, so a new export or onnxruntime is optimised
            afresh and the older copy of that graph file removed; an
            unreadable copy is optimised again with a warning, and a
            directory that cannot be created means no cache (a warning).
            With the default session options only. `python -m
            export.runtime` uses `default_optimized_cache()` unless told
            otherwise.
        driver: "steps": `generate` and `generate_hypotheses` run the
            start graph, the fused decoder step and the update graph
            (`export.steps`: rows that are done leave the batch, the cache
            grows with the output); "whole": the whole-search graphs, one
            call per batch (every row until the longest is done). The same
            tokens. None (the default): "steps" on the CPU when the export
            has the fused step (models it covers: `export/fused_step.py`);
            otherwise, and under CUDA (where the driver's host buffers
            would cross to the device every step; not measured on a GPU
            yet), "whole".

    Attributes: `vocabulary_size`, `encoder_vocabulary_size`, `pad_id`, `unk_id`, `start_id`, `end_id`,
    `max_sequence_length`, `config` (the directory's `config.json`),
    `providers` (those the sessions run with).

    Example:
    >>> model = OnnxSeq2Seq("exported/onnx")
    >>> model.generate(np.array([[5, 6, 7, 3]]), beam_size=4)[0, 0]
    2
    """

    # The decoding protocol's optional attribute (`TransformerModel`'s): entries beam search leaves in place.
    beam_invariant_cache_keys = ("cross_key", "cross_value", "encoder_padding_mask")

    def __init__(
        self, directory, providers=None, use_io_binding=None, session_options=None, intra_op_threads=None,
        optimized_cache=None, driver=None,
    ):
        if driver is not None and driver not in DRIVERS:
            raise ValueError(f"driver={driver!r} must be one of {DRIVERS} or None")
        self.directory = pathlib.Path(directory)
        if optimized_cache is not None and session_options is not None:
            raise ValueError("optimized_cache works with the default session options; pass intra_op_threads, "
                             "not session_options")
        self.config = read_config(self.directory)
        config = self.config
        try:
            self.vocabulary_size = int(config["vocabulary_size"])
            # The source ids: a table of the encoder's own (`source_vocabulary_size`), or the shared vocabulary.
            self.encoder_vocabulary_size = int(config.get("source_vocabulary_size") or self.vocabulary_size)
            self.pad_id, self.unk_id = int(config["pad_id"]), int(config["unk_id"])
            self.start_id, self.end_id = int(config["start_id"]), int(config["end_id"])
            self.max_sequence_length = int(config["max_sequence_length"])
            self.hidden_dim = int(config["hidden_dim"])
            self._cache_dtype = np.dtype(config["cache_dtype"]).name
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{self.directory / CONFIG_FILE} lacks or garbles {error}; export again") from None
        self._session_options = session_options or _session_options(intra_op_threads)
        self._intra_op_threads = intra_op_threads
        self._optimized_cache = None if optimized_cache is None else pathlib.Path(optimized_cache)
        self._requested = resolve_providers(providers, probe_path=self._graph_path("encoder"))
        self.providers = [p[0] if isinstance(p, (tuple, list)) else p for p in self._requested]
        self._device = "cuda" if self.providers[0] == CUDA else "cpu"
        self.use_io_binding = self._device == "cuda" if use_io_binding is None else bool(use_io_binding)
        has_steps = "fused_decoder_step" in config.get("graphs", {})
        if driver == "steps" and not has_steps:
            raise ValueError(
                f"{self.directory} has no fused decoder step (its model is not one the fused step covers: "
                "export/fused_step.py), so it cannot run driver='steps'; use driver='whole' or None"
            )
        self.driver = driver or ("steps" if has_steps and self._device == "cpu" else "whole")
        self._sessions = {}
        # Graph input name -> (host array, the OrtValue made from it).
        self._device_values = {}

    def _graph_path(self, graph):
        return self.directory / self.config["graphs"][graph]

    def _session(self, graph):
        """The ONNX Runtime session of `graph`, created and checked on first use."""
        if graph not in self._sessions:
            path = self._graph_path(graph)
            session = self._cached_session(graph) if self._optimized_cache is not None else None
            if session is None:
                options, saved = self._session_options, None
                if self._optimized_cache is not None:
                    options, saved = self._options_saving(graph)
                try:
                    session = new_session(path, options, self._requested)
                except Exception as error:  # noqa: BLE001 - re-raised naming the file
                    raise ValueError(f"ONNX Runtime could not load {path}: {error}") from error
                if saved is not None:
                    self._keep_optimized(graph, saved)
            try:
                check_graph_signature(session, graph, self.config)
            except ValidationError as error:
                raise ValueError(f"{path} does not match export format {contract.ONNX.version}: {error}") from None
            self.providers = session.get_providers()
            self._sessions[graph] = session
        return self._sessions[graph]

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

    def _run(self, graph, values, keep_on_device=()):
        """Runs one graph on `{input name: value}`; returns `{output name: NumPy array}`.

        The feeds take the contract's dtypes (`contract.feeds`). With I/O
        binding, inputs go through `_device_value`, and the outputs named in
        `keep_on_device` (`output name -> input name` it will be fed back
        as) are remembered on the device for the next call. The host copies
        handed out are read-only, so an array passed back by identity is
        known to hold the same values as its device copy.
        """
        session, spec = self._session(graph), contract.ONNX.graphs[graph]
        if not self.use_io_binding:
            return contract.run(session, spec, values, self._cache_dtype)
        feeds, output_names = contract.feeds(spec, values, self._cache_dtype), spec.output_names()
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
        return dict(zip(output_names, results))

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
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.encoder_vocabulary_size)
        self._check_length(ids.shape[1], "encoder_token_ids")
        return self._run("encoder", {"encoder_token_ids": ids})["encoder_outputs"]

    def init_cache(self, encoder_outputs, encoder_token_ids, max_length):
        """The decoding cache for `max_length` target positions (as `TransformerModel.init_cache`).

        Returns:
            dict of NumPy arrays: `self_key [B, L, N, T_max, K]`,
            `self_value [B, L, N, T_max, Vh]`, `cross_key [B, L, N, S, K]`,
            `cross_value [B, L, N, S, Vh]`, `encoder_padding_mask [B, S]` bool.
        """
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.encoder_vocabulary_size)
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
        values = {"encoder_outputs": outputs, "encoder_token_ids": ids, "max_length": int(max_length)}
        # Every entry is fed back to decoder_step under its own name.
        return self._run("init_cache", values, keep_on_device={name: name for name in CACHE_KEYS})

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
        outputs = self._run(
            "decoder_step",
            {**feeds, "decoder_token_ids": ids, "step": index},
            keep_on_device={"updated_self_key": "self_key", "updated_self_value": "self_value"},
        )
        updated = {name: outputs[f"updated_{name}"] for name in ("self_key", "self_value")}
        return outputs["logits"], dict(cache, **updated)

    def alignment_attention(self, encoder_token_ids, decoder_token_ids):
        """The cross-attention that aligns, teacher forced (as `TransformerModel.alignment_attention`).

        Runs the fused decoder step with its attention output
        (`fused_step.with_alignment_output`: a second session of the
        export's step graph, made on the first call; the `onnx` package
        builds it) over the target rows, with the source's cross-attention
        cache from the `encoder` and `init_cache` graphs.

        Returns:
            float32 `[B, T, S]`: row t, decoder position t's weights over the source.

        Raises:
            ValueError: one line naming the fix: an export without the fused
                decoder step, or without the `onnx` package.
        """
        from export.steps import FusedDecoder

        source = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.encoder_vocabulary_size)
        target = _check_ids(decoder_token_ids, "decoder_token_ids", 2, self.vocabulary_size)
        self._check_length(target.shape[1], "decoder_token_ids")
        session = self._alignment_session()
        cache = self.init_cache(self.encode(source), source, 1)  # the cross-attention keys and values
        start = dict(cache, buffer_length=max(target.shape[1], 1))
        decoder = FusedDecoder(session, start, 1, initial_length=target.shape[1])
        attention = np.zeros((*target.shape, source.shape[1]), np.float32)  # [B, T, S]
        for index in range(target.shape[1]):
            decoder.step(np.ascontiguousarray(target[:, index]), index)
            attention[:, index] = decoder.attention
        return attention

    def check_alignment(self):
        """Raises `alignment_attention`'s one-line ValueError here, before a search, where it cannot run."""
        self._alignment_session()

    def _alignment_session(self):
        """The session of the fused step with `ALIGNMENT_OUTPUT` (`alignment_attention`), made once."""
        if "alignment_step" not in self._sessions:
            if "fused_decoder_step" not in self.config.get("graphs", {}):
                raise ValueError(
                    f"return_alignment: {self.directory} has no fused decoder step (its model is not one the fused "
                    "step covers: export/fused_step.py); align with the Keras model (Translator.from_preset)"
                )
            try:
                import onnx
            except ImportError:
                raise ValueError("return_alignment on ONNX Runtime builds the step's attention output with the "
                                 "onnx package: pip install onnx") from None
            from export.fused_step import with_alignment_output
            from keras_transformer.documents.alignment import ALIGNMENT_LAYER

            step = with_alignment_output(onnx.load(str(self._graph_path("fused_decoder_step"))), ALIGNMENT_LAYER)
            self._sessions["alignment_step"] = new_session(step.SerializeToString(), self._session_options,
                                                           self._requested)
        return self._sessions["alignment_step"]

    def generate(
        self, encoder_token_ids, *, return_scores=False, options=None, cancelled=None, finished=None, **search_keywords
    ):
        """Greedy (`beam_size=1`) or beam search.

        The search of `TransformerModel.generate` (GNMT length penalty, at
        most source length + `max_extra_length` tokens per row), exported:
        the same tokens. With the default driver, beam search runs the
        `beam_start` / `beam_update` graphs and greedy search `sample_start`
        / `greedy_update` around the fused decoder step (`export.steps`);
        with `driver="whole"`, the `beam_search` / `greedy_search` graph in
        one call. With a `patience`, beam search is `generate_hypotheses`'
        best (as `generation.generate`). `options`: a `SearchOptions`, or
        instead `**search_keywords` (`beam_size`, `length_penalty`,
        `max_extra_length`, `patience`; one or the other). `cancelled`:
        None, or a callable asked after each step of the step driver, which
        returns None or bool `[B]`: the rows marked leave the search at once
        (a server's client left) and get no tokens (start id, end id; score
        -inf); the whole-search graphs run every row to its end.
        `finished`: None, or a callable the step driver tells, after each
        step at which rows ended, `finished(rows, sequences)`: their
        indices (int `[n]`) and final tokens (as returned, `[n, L]`); the
        whole-search graphs tell nobody.

        Returns:
            int32 NumPy array `[B, L]`: start id, tokens, end id, then 0s;
            with `return_scores=True`, also the float32 scores `[B]`.
        """
        options = call_options("generate", options, search_keywords, BEAM)
        refuse_hypotheses(options, "generate", "generate_hypotheses")
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.encoder_vocabulary_size)
        self._check_length(ids.shape[1], "encoder_token_ids")
        if ids.shape[0] == 0:
            empty = np.zeros((0, 0), np.int32)
            return (empty, np.zeros((0,), np.float32)) if return_scores else empty
        if options.patience is not None and options.beam_size > 1:  # the n-best search's, as `generation.generate`
            told = None if finished is None else (
                lambda rows, found: finished(rows, finish_rows(found.sequences[:, 0], self.end_id, self.pad_id))
            )
            best = self.generate_hypotheses(ids, options=options, cancelled=cancelled, finished=told)
            sequences = finish_rows(best.sequences[:, 0], self.end_id, self.pad_id)
            return (sequences, best.scores[:, 0]) if return_scores else sequences
        if self.driver == "steps":
            plan = options.plan(ids)
            told = None if finished is None else (
                lambda rows, found, *_: finished(rows, finish_rows(found[:, 0], self.end_id, self.pad_id))
            )
            sequences, scores, _ = self._step_search(
                plan, options.length_penalty, options.max_extra_length, cancelled, told
            )
            sequences, scores = sequences[:, 0], scores[:, 0]
            if cancelled is not None:
                # Cancelled rows were never written (all 0s; a searched row starts with the start id): no tokens.
                # Not read from the scores: a searched row's score may be -inf too (a random int8 model's greedy).
                left = ~sequences.any(axis=1)
                sequences[left, :2] = self.start_id, self.end_id
        else:
            values = {"encoder_token_ids": np.ascontiguousarray(ids), "alpha": options.length_penalty,
                      "max_extra_length": options.max_extra_length}
            graph = "greedy_search"
            if options.beam_size > 1:
                graph, values["beam_size"] = "beam_search", options.beam_size
            outputs = contract.run(self._session(graph), contract.ONNX.graphs[graph], values, self._cache_dtype)
            sequences, scores = outputs["sequences"], outputs["scores"]
        sequences = finish_rows(sequences, self.end_id, self.pad_id)
        return (sequences, scores) if return_scores else sequences

    def _step_search(self, plan, length_penalty, max_extra_length, cancelled=None, finished=None):
        """Runs a `decoding.hypotheses_plan` step by step (`export.steps.step_search`).

        `cancelled`: None or a callable of flags per row of the plan (`generate`); `finished`: `step_search`'s.
        """

        def run(graph, values):
            return contract.run(self._session(graph), contract.ONNX.graphs[graph], values, self._cache_dtype)

        update = self._session(contract.STEP_GRAPHS[plan.search_name][1])
        return step_search(
            run, self._session("fused_decoder_step"), plan, length_penalty, max_extra_length, update_session=update,
            cancelled=cancelled, finished=finished,
        )

    def generate_hypotheses(
        self, encoder_token_ids, *, target_prefix=None, options=None, cancelled=None, finished=None, **search_keywords
    ):
        """`keras_transformer.generation.generate_hypotheses` on ONNX Runtime.

        The same plan (`decoding.hypotheses_plan`), checks and results,
        run by the exported beam search (`beam_start` / `beam_update`) or
        sampling (`sample_start` / `sample_update`; greedy search
        `sample_start` / `greedy_update`) around the fused decoder step
        (`export.steps`), or with
        `driver="whole"` by the `beam_hypotheses` / `sample_search` graph in
        one call: the same tokens, scores and log-probabilities (within
        float32 rounding), the same samples for the same seed. `options`: a
        `SearchOptions`, or instead `**search_keywords` (any of its fields;
        one or the other).
        `cancelled`: as `generate`'s (a cancelled row's hypotheses all
        have score -inf: none). `finished`: None, or a callable the step
        driver tells, after each step at which source rows ended (all their
        samples), `finished(rows, hypotheses)`: their indices (int `[n]`)
        and final `Hypotheses` (as returned, `[n, ...]`).

        Returns:
            `Hypotheses(sequences [B, n, L], scores [B, n], log_probs [B, n])`, best first.
        """
        options = call_options("generate_hypotheses", options, search_keywords)
        ids = _check_ids(encoder_token_ids, "encoder_token_ids", 2, self.encoder_vocabulary_size)
        self._check_length(ids.shape[1], "encoder_token_ids")
        prefix = target_prefix_ids(target_prefix, ids.shape[0], self)
        if ids.shape[0] == 0:
            return no_hypotheses(options.count)
        plan = options.plan(ids, prefix)
        if self.driver == "steps":
            sequences, scores, log_probs = self._step_search(
                plan, options.length_penalty, options.max_extra_length,
                _repeated(cancelled, len(plan.source) // len(ids)),  # sampling repeats each row per sample
                _collected(finished, plan, len(ids), options.count, self),
            )
        else:
            graph, values = contract.hypotheses_feeds(plan, options.length_penalty, options.max_extra_length)
            outputs = contract.run(self._session(graph), contract.ONNX.graphs[graph], values, self._cache_dtype)
            sequences, scores, log_probs = outputs["sequences"], outputs["scores"], outputs["log_probs"]
        return collect_hypotheses(plan, sequences, scores, log_probs, options.count, self)


def _repeated(cancelled, repeats):
    """`cancelled` (None, or a callable of flags per source row) for a plan that repeats each row `repeats` times."""
    if cancelled is None or repeats == 1:
        return cancelled

    def flags():
        found = cancelled()
        return None if found is None else np.repeat(np.asarray(found, bool), repeats)

    return flags


def _collected(finished, plan, sources, count, model):
    """`finished` (None, or a callable of source rows and their `Hypotheses`) as `step_search`'s callable.

    The plan repeats each source row once per sample (rows `i * R ... i * R + R - 1`): a source row
    ends when all its rows have, and its hypotheses are collected then (`collect_hypotheses`).
    """
    if finished is None:
        return None
    repeats = len(plan.source) // sources
    found, left = {}, np.full(sources, repeats)

    def told(rows, sequences, scores, log_probs):
        for row, *hypotheses in zip(rows, sequences, scores, log_probs):
            found[int(row)] = hypotheses
        ended = np.unique(rows // repeats)
        np.subtract.at(left, rows // repeats, 1)
        ended = ended[left[ended] == 0]
        if len(ended):
            own = [found.pop(int(i) * repeats + r) for i in ended for r in range(repeats)]
            finished(ended, collect_hypotheses(plan, *(np.stack(x) for x in zip(*own)), count, model))

    return told
