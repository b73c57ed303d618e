"""The step driver: a search's start graph, then the fused decoder step and its update graph per step.

`step_search` runs a `decoding.hypotheses_plan`: the search's
`<search>_start` graph (lengths, encoder, the source's cross-attention
cache, the search's `init`) once per group of sources of similar lengths
(`start_groups`: the encoder runs over its group padded to the group's
longest, not the batch's), then per step the fused decoder step
(`export/fused_step.py`, through `FusedDecoder`) and the search's
`<search>_update` graph (its update, the next ids, each new beam's parent,
`rows_done`, `keep_going`, `hypotheses`). Rows that are done leave the batch
and the self-attention cache grows with the output, as CTranslate2 does: a
batch costs the steps of its own rows, not its longest row's steps times
its size. The search's logic is the graphs' (the Keras search, converted);
this module only moves arrays, by the contract's axis names.

The self-attention cache is never copied per step: the fused step writes
each step's keys and values in place (its `present_*` outputs are bound to
its `self_*` inputs' buffers with I/O binding), and beam search moves the
small `cache_indirection` table (`fused_step.update_indirection`) instead of
the cache. The buffers are copied only when the cache grows; when rows leave,
live rows from the batch's end take their places (`fill_holes`). The update
graph writes into bound buffers too (`BoundUpdate`).

Framework-free (NumPy, onnxruntime and `export.contract`): the ONNX Runtime
server (`export/runtime.py`) and the export's validation
(`export/validate.py`) run it.
"""

import operator

import numpy as np

from export import contract
from export.fused_step import update_indirection
from keras_transformer.decoding import LENGTH_BUCKET

# The self-attention cache's first length: as many positions as fit in
# FIRST_CACHE_BYTES (the whole buffer at small batches: the fused step's
# time does not depend on the buffer's length, only on the positions
# written, while each growth copies the cache and binds it again), at least
# INITIAL_CACHE_LENGTH; doubled (up to the output buffer length) whenever
# the output reaches it.
INITIAL_CACHE_LENGTH = 16
FIRST_CACHE_BYTES = 32 << 20
# The start graph runs the encoder over its batch padded to the longest source (rounded up to
# LENGTH_BUCKET): `step_search` sorts the sources by length and runs it on groups that waste at most
# START_PADDING_SLACK of their real tokens, or START_PADDING_TOKENS, in padding (each call costs about as
# much as encoding 10-20 tokens of the `small` model here).
START_PADDING_SLACK = 0.25
START_PADDING_TOKENS = 32
# `OnnxSeq2Seq(driver=...)`: this module's loop, or the whole-search graphs.
DRIVERS = ("steps", "whole")
_HYPOTHESES = ("sequences", "scores", "log_probs")


class FusedDecoder:
    """Runs the fused decoder step over its own buffers, bound once (ONNX Runtime I/O binding).

    Args:
        session: an `onnxruntime.InferenceSession` of `fused_decoder_step`.
        start: the start graph's outputs (`cross_key`, `cross_value` `[B,
            L, N, S, H]`, `encoder_padding_mask` `[B, S]`, `buffer_length`).
        beam_size: K (1 for greedy search and sampling).
        initial_length: the self-attention cache's first length (default:
            `FIRST_CACHE_BYTES`' worth, at least `INITIAL_CACHE_LENGTH`).
    """

    def __init__(self, session, start, beam_size, initial_length=None):
        self.session, self.beam_size = session, int(beam_size)
        self.buffer_length = int(start["buffer_length"])
        cross_key, cross_value = start["cross_key"], start["cross_value"]
        self.num_layers = cross_key.shape[1]
        self.source = {"encoder_padding_mask": np.ascontiguousarray(start["encoder_padding_mask"], np.int32)}
        for i in range(self.num_layers):
            self.source[f"cross_key_{i}"] = np.ascontiguousarray(cross_key[:, i])
            self.source[f"cross_value_{i}"] = np.ascontiguousarray(cross_value[:, i])
        batch, _, heads, _, head_dim = cross_key.shape
        rows = batch * self.beam_size
        if initial_length is None:  # the positions that fit in FIRST_CACHE_BYTES (keys and values of every layer)
            position_bytes = rows * heads * head_dim * np.dtype(np.float32).itemsize * 2 * self.num_layers
            initial_length = max(INITIAL_CACHE_LENGTH, FIRST_CACHE_BYTES // position_bytes)
        length = min(initial_length, self.buffer_length)
        self.cache = {
            f"self_{kind}_{i}": np.zeros((rows, heads, length, head_dim), np.float32)
            for i in range(self.num_layers) for kind in ("key", "value")
        }
        self.indirection = np.zeros((batch, self.beam_size, length), np.int32)
        self.filled = 0  # positions of the cache written so far
        self._logits_buffer = None  # [B*K, V], made by the first `_bind`; rows only leave
        self.logits = None  # its first rows, the step's logits
        self._bind()

    def _bind(self):
        import onnxruntime as ort

        self.binding = self.session.io_binding()
        # The OrtValues share the arrays' memory (CPU); kept here so that both stay alive.
        self._values = {}
        for name, array in self.source.items():
            self._values[name] = value = ort.OrtValue.ortvalue_from_numpy(array)
            self.binding.bind_ortvalue_input(name, value)
        self._bind_cache()
        rows = next(iter(self.cache.values())).shape[0]
        # The step's token ids and index: buffers bound once, written in place by `step`.
        self._token_ids, self._index = np.zeros((rows,), np.int32), np.zeros((), np.int32)
        for name, array in (("decoder_token_ids", self._token_ids), ("index", self._index)):
            self._values[name] = value = ort.OrtValue.ortvalue_from_numpy(array)
            self.binding.bind_ortvalue_input(name, value)
        if self._logits_buffer is None:
            vocabulary = self.session.get_outputs()[0].shape[1]
            self._logits_buffer = np.zeros((rows, vocabulary), np.float32)
        if self.logits is None or len(self.logits) != rows:  # the same array while rows stay
            self.logits = self._logits_buffer[:rows]  # rows only leave: a prefix of the first buffer
        self._values["logits"] = value = ort.OrtValue.ortvalue_from_numpy(self.logits)
        self.binding.bind_ortvalue_output("logits", value)

    def _bind_cache(self):
        """Binds the self-attention cache (input and in-place output) and the cache indirection."""
        import onnxruntime as ort

        for name, array in {**self.cache, "cache_indirection": self.indirection}.items():
            self._values[name] = value = ort.OrtValue.ortvalue_from_numpy(array)
            self.binding.bind_ortvalue_input(name, value)
            if name in self.cache:
                self.binding.bind_ortvalue_output(f"present_{name}", value)  # written in place

    def _grow(self, length):
        """New self-attention buffers of `length` positions; binds them (the other buffers stay bound).

        Only the positions written so far are copied: the fused step reads
        positions below its index only, and writes the index before it reads it.
        """
        for name, array in self.cache.items():
            new = np.empty((*array.shape[:2], length, array.shape[3]), np.float32)
            new[:, :, :self.filled] = array[:, :, :self.filled]
            self.cache[name] = new
        extra = length - self.indirection.shape[2]
        self.indirection = np.ascontiguousarray(np.pad(self.indirection, ((0, 0), (0, 0), (0, extra))))
        self._bind_cache()

    def step(self, token_ids, index):
        """The logits `[B*K, V]` of position `index + 1` (a buffer overwritten by the next step)."""
        length = self.indirection.shape[2]
        if index >= length:
            self._grow(min(max(2 * length, index + 1), self.buffer_length))
        if np.shape(token_ids) != self._token_ids.shape:  # (assigning would broadcast one id to every row)
            raise ValueError(f"{np.shape(token_ids)} token ids for a cache of {len(self._token_ids)} rows")
        self._token_ids[...] = token_ids
        self._index[...] = index
        self.session.run_with_iobinding(self.binding)
        self.filled = index + 1
        return self.logits

    def reorder(self, parents, index):
        """Beam search picked `parents` `[B, K]` after the step at `index`."""
        written = self.indirection[:, :, : index + 1]  # the positions after it are not read yet
        written[...] = update_indirection(written, parents, index)

    def keep(self, kept):
        """Keeps the sources `kept` (`fill_holes`' order) and their beams; rebinds.

        Only the rows that `fill_holes` moves are copied, in place: those of
        the self-attention cache (the positions written so far) and of the
        source's cross-attention keys, values and padding mask. The buffers
        become their first rows: no new buffer per departure.
        """
        rows = beam_rows(kept, self.beam_size)
        self.cache = {name: _fill_holes(array, rows, self.filled) for name, array in self.cache.items()}
        self.source = {name: _fill_holes(array, kept) for name, array in self.source.items()}
        self.indirection = np.ascontiguousarray(self.indirection[kept])
        self._bind()


class BoundUpdate:
    """Runs a search's update graph into bound output buffers: two sets that take turns.

    The update's state outputs (`updated_<name>`) are its next inputs: a
    run reads one set of buffers and writes the other, through ONNX
    Runtime I/O binding made once, so a step neither converts its inputs
    nor allocates its outputs (`session.run` did both: at batch 1 about a
    third of a greedy update's 80 us). The returned arrays are the buffers
    themselves, valid until the run after next. A call whose state or other
    inputs are not the arrays bound (the first step, rows that left, a
    cache that grew) runs the plain way and binds anew.

    Args:
        session: the update graph's `onnxruntime.InferenceSession`.
        graph: its `contract.Graph`.
        plain: `{input name: value} -> {output name: array}`, one run without
            the buffers (`contract.run`).
    """

    def __init__(self, session, graph, plain):
        self.session, self.graph, self.plain = session, graph, plain
        self.carried = carried_state(graph)
        # Two `(input names, their arrays, binding, outputs, OrtValues kept alive)`; `turn` the one likelier next.
        self.bindings, self.turn = [], 0

    def __call__(self, feeds):
        for turn in (self.turn, 1 - self.turn) if self.bindings else ():
            names, arrays, binding, outputs, _ = self.bindings[turn]
            # By identity, in C (`map`): between two ONNX Runtime runs each Python step runs with cold caches.
            if all(map(operator.is_, map(feeds.__getitem__, names), arrays)):
                self.session.run_with_iobinding(binding)
                self.turn = 1 - turn  # its outputs are the other set's inputs
                return outputs
        first = {name: np.array(array, order="C") for name, array in self.plain(feeds).items()}
        second = {name: np.empty_like(array) for name, array in first.items()}
        fixed = {name: value for name, value in feeds.items() if name not in self.carried}  # as fed, for identity
        self.bindings, self.turn = [self._bind(fixed, first, second), self._bind(fixed, second, first)], 1
        return first

    def _bind(self, fixed, source, target):
        import onnxruntime as ort

        inputs = dict(fixed, **{name: source[output] for name, output in self.carried.items()})
        arrays = contract.feeds(self.graph, inputs, "float32")  # no array is computed-dtype in an update graph
        binding, kept = self.session.io_binding(), []
        for name, array in arrays.items():
            kept.append(ort.OrtValue.ortvalue_from_numpy(np.require(array, requirements="C")))
            binding.bind_ortvalue_input(name, kept[-1])
        for name, array in target.items():
            kept.append(ort.OrtValue.ortvalue_from_numpy(array))  # shares the array's memory: written in place
            binding.bind_ortvalue_output(name, kept[-1])
        return tuple(inputs), tuple(inputs.values()), binding, target, kept


def carried_state(graph):
    """`{state input: the update graph's output that is its next value}` (`x` and `updated_x`)."""
    outputs = set(graph.output_names())
    return {name: f"updated_{name}" for name in graph.input_names() if f"updated_{name}" in outputs}


def fill_holes(live):
    """The rows that stay when the rows not `live` (bool `[B]`) leave, in their new order.

    The n live rows become rows 0..n-1: a live row among the first n stays
    where it is, and each hole left there by a departing row takes one of
    the live rows after the first n. A departure then moves as many rows as
    leave from the first n (`FusedDecoder.keep`), not every row after the
    first that leaves: at batch 64 x beam 4 at natural lengths, rows
    leaving one by one, keeping the rows' order cost 81 ms of a 1.85 s
    search (this, 17 ms). Rows are independent, so their order changes no
    result (`run_steps` tracks each row's place).

    Returns:
        int `[n]`: `kept[i]` is the old row that becomes row i.
    """
    live = np.asarray(live, bool)
    kept = np.arange(int(live.sum()))
    holes = np.flatnonzero(~live[: len(kept)])
    kept[holes] = np.flatnonzero(live[len(kept):]) + len(kept)
    return kept


def beam_rows(kept, beam_size):
    """The `[B * K]` rows (`b * K + k`) of sources `kept`, in their order."""
    return (np.asarray(kept)[:, None] * beam_size + np.arange(beam_size)).reshape(-1)


def _fill_holes(array, kept, positions=None):
    """`array[kept]` as the first rows of `array`, in place (`fill_holes`' order); returns them (a view).

    `positions`: copy only the first positions of axis 2 (those written so
    far, for the self-attention cache).
    """
    moved = np.flatnonzero(kept != np.arange(len(kept)))
    if len(moved):
        where = (slice(None), slice(None, positions)) if positions is not None else ()
        array[(moved, *where)] = array[(kept[moved], *where)]  # the right side is a copy
    return array[: len(kept)]


def run_steps(update, graph, decoder, values, cancelled=None, finished=None):
    """Runs the decoder and the search's update graph until every row is done; done rows leave.

    After each step, the rows that `rows_done` marks (all rows once
    `keep_going` is false) hand out their hypotheses, which no longer
    change, and every input with a batch axis (the contract's axis names:
    `batch`, one row per source; `beam_rows`, rows `b * K ... b * K + K - 1`)
    keeps the other rows only, as does the decoder (`FusedDecoder.keep`).
    The search's logic is the graph's; this loop only moves arrays.

    Rows leave as soon as they are done: letting them wait in the batch
    until a fifth of it is done was no faster at batch 16 and 64 with the
    format-5 step graphs (benchmarks/README.md; not measured again with
    the fused step, whose departures cost less).

    Args:
        update: `{input name: array} -> {output name: array}`, one run of `graph`.
        graph: the search's update graph's `contract.Graph` (`beam_update`, ...).
        decoder: a `FusedDecoder`.
        values: `{name: array}`: every input of `graph` but `logits`, and
            `decoder_token_ids` (the start graph's).
        cancelled: None, or a callable asked after each step: None (no row
            leaves) or bool `[B]` in the order of `values`' rows, true for
            the rows nobody waits for any more (a server's client left):
            they leave the batch as done rows do, before the next step,
            without hypotheses (sequences 0, scores and log-probabilities
            -inf); once every row is done or cancelled the search ends.
        finished: None, or a callable told after each step at which rows
            ended (not the cancelled ones): `finished(rows, sequences,
            scores, log_probs)`, `rows` their places in `values` (int `[n]`)
            and the arrays their hypotheses (`[n, K, L]`, `[n, K]`,
            `[n, K]`), final: what the returned arrays hold at those places.

    Returns:
        `(sequences [B, K, L], scores [B, K], log_probs [B, K])` NumPy arrays,
        each row's hypotheses at its place in the batch (K = 1 where the
        graph's outputs have no `hypotheses` axis).
    """
    token_ids = values["decoder_token_ids"]
    values = {name: values[name] for name in graph.input_names() if name != "logits"}
    batch = len(values["max_lengths"])
    places = np.arange(batch)  # each live row's place in the batch
    outputs_by_name = {tensor.name: tensor for tensor in graph.outputs}
    hypotheses_axes = {f"hypotheses_{name}": outputs_by_name[f"hypotheses_{name}"].axes for name in _HYPOTHESES}
    carried = tuple(carried_state(graph).items())
    reorders = "parents" in outputs_by_name
    results = None
    while True:
        index = int(values["index"])
        outputs = update(dict(values, logits=decoder.step(token_ids, index)))
        for name, output in carried:
            values[name] = outputs[output]
        token_ids = outputs["decoder_token_ids"]
        if reorders:
            decoder.reorder(outputs["parents"], index)
        keep_going = bool(outputs["keep_going"])
        done = np.asarray(outputs["rows_done"], bool) if keep_going else np.ones(len(places), bool)
        dropped = _cancelled_rows(cancelled, places, done) if keep_going and cancelled is not None else None
        any_done = np.count_nonzero(done) > 0  # (`done.any()` goes through a ufunc reduction)
        if any_done or dropped is not None:  # the hypotheses are read only for rows that are done
            hypotheses = [
                outputs[name] if "hypotheses" in axes else np.expand_dims(outputs[name], 1)
                for name, axes in hypotheses_axes.items()
            ]
            if results is None:
                results = [np.zeros((batch, *x.shape[1:]), x.dtype) for x in hypotheses]
            for result, x in zip(results, hypotheses):
                result[places[done]] = x[done]
            if finished is not None and any_done:
                finished(places[done], *(x[done] for x in hypotheses))
            if dropped is not None:
                for result in results[1:]:  # scores and log-probabilities: no hypothesis
                    result[places[dropped]] = -np.inf
                done = done | dropped
                any_done, keep_going = True, not done.all()
        if not keep_going:
            return tuple(results)
        if any_done:
            kept = fill_holes(~done)
            places = places[kept]
            kept_rows = beam_rows(kept, decoder.beam_size)
            token_ids = token_ids[kept_rows]
            for tensor in graph.inputs:
                if tensor.name in values and tensor.axes[:1] == ("batch",):
                    values[tensor.name] = values[tensor.name][kept]
                elif tensor.name in values and tensor.axes[:1] == ("beam_rows",):
                    values[tensor.name] = values[tensor.name][kept_rows]
            decoder.keep(kept)


def _cancelled_rows(cancelled, places, done):
    """The live rows (bool `[n]`, at their places now) that `cancelled()` marks and are not done, or None."""
    flags = cancelled()
    if flags is None:
        return None
    dropped = np.asarray(flags, bool)[places] & ~done
    return dropped if np.count_nonzero(dropped) else None


def step_search(
    run, decoder_session, plan, length_penalty, max_extra_length, initial_cache_length=None, update_session=None,
    cancelled=None, finished=None,
):
    """Runs a `decoding.hypotheses_plan` with its search's start and update graphs and the fused step.

    Args:
        run: `(graph name, {input name: value}) -> {output name: array}`.
        decoder_session: the `fused_decoder_step` graph's ONNX Runtime session.
        plan: a `decoding.HypothesesPlan`; its search's graphs are
            `contract.STEP_GRAPHS[plan.search_name]`.
        length_penalty, max_extra_length: as `generate_hypotheses`.
        initial_cache_length: the self-attention cache's first length
            (default: as `FusedDecoder`'s).
        update_session: the update graph's ONNX Runtime session: its runs
            then write into bound buffers (`BoundUpdate`); without it, each
            step's update is one call of `run`.
        cancelled: None, or `run_steps`' callable, its flags in the plan's
            row order.
        finished: None, or `run_steps`' callable, told the rows' places in
            the plan's order.

    The rows are sorted by source length for the start graph's groups
    (`start_groups`, `merge_start_outputs`) and run so; the results are
    put back in the plan's order (rows are independent).

    Returns:
        `(sequences [B, K, L], scores [B, K], log_probs [B, K])`, as the
        whole-search graph of the plan returns them.
    """
    _, values = contract.hypotheses_feeds(plan, length_penalty, max_extra_length)
    start_name, update_name = contract.STEP_GRAPHS[plan.search_name]
    start, update = contract.ONNX.graphs[start_name], contract.ONNX.graphs[update_name]
    lengths = np.count_nonzero(plan.source, axis=1)
    order = np.argsort(lengths, kind="stable")  # rows are independent: sorted, then put back
    lengths = lengths[order]
    batch_inputs = {tensor.name for graph in (start, update) for tensor in graph.inputs if tensor.axes[:1] == ("batch",)}
    values = {name: value[order] if name in batch_inputs else value for name, value in values.items()}
    outputs = []
    for rows in start_groups(lengths):
        feeds = {name: values[name][rows] if name in batch_inputs else values[name] for name in start.input_names()}
        feeds["encoder_token_ids"] = feeds["encoder_token_ids"][:, : max(int(lengths[rows][-1]), 1)]  # sorted
        outputs.append(run(start_name, feeds))
    values.update(merge_start_outputs(start, outputs))
    decoder = FusedDecoder(decoder_session, values, plan.beam_size, initial_cache_length)
    update_run = lambda feeds: run(update_name, feeds)  # noqa: E731
    if update_session is not None:
        update_run = BoundUpdate(update_session, update, update_run)
    places = np.argsort(order)  # each row's place in the sorted batch
    told = None if finished is None else lambda rows, *found: finished(order[rows], *found)
    results = run_steps(update_run, update, decoder, values, _reordered(cancelled, order), told)
    return tuple(result[places] for result in results)


def _reordered(cancelled, order):
    """`cancelled` (None, or a callable of flags in the plan's row order) for the rows taken in `order`."""
    if cancelled is None:
        return None

    def flags():
        found = cancelled()
        return None if found is None else np.asarray(found, bool)[order]

    return flags


def start_groups(lengths):
    """Consecutive row ranges of sorted source `lengths` to run the start graph on, one call each.

    The start graph pads a group to its longest length rounded up to
    `LENGTH_BUCKET`; a group grows while that padding, beyond what each
    row would have alone (its own length rounded up), stays within
    `START_PADDING_SLACK` of its real tokens or `START_PADDING_TOKENS`.

    Returns:
        A list of slices that cover `range(len(lengths))` in order.
    """
    lengths = np.asarray(lengths, np.int64)
    bucketed = -(-lengths // LENGTH_BUCKET) * LENGTH_BUCKET
    groups, first = [], 0
    for end in range(1, len(lengths)):  # may row `end` join the group `first..end - 1`?
        waste = (end + 1 - first) * bucketed[end] - bucketed[first: end + 1].sum()
        if waste > max(START_PADDING_SLACK * lengths[first: end + 1].sum(), START_PADDING_TOKENS):
            groups.append(slice(first, end))
            first = end
    return groups + [slice(first, len(lengths))]


def merge_start_outputs(graph, outputs):
    """One start graph output from the outputs of several groups of rows (`start_groups`), in their order.

    Arrays with a batch axis (`batch`, `beam_rows`) are concatenated
    along it, each padded first on its other dynamic axes (the source
    length, the output buffer length) to the longest group's with zeros
    (`False` for the padding mask: the pad positions a single call would
    have had); scalars are the same in every group but `buffer_length`,
    the largest.
    """
    if len(outputs) == 1:
        return outputs[0]
    merged = {}
    for tensor in graph.outputs:
        arrays = [np.asarray(output[tensor.name]) for output in outputs]
        if not tensor.axes:
            merged[tensor.name] = max(arrays, key=int) if tensor.name == "buffer_length" else arrays[0]
            continue
        shape = np.max([array.shape for array in arrays], axis=0)
        merged[tensor.name] = np.concatenate([
            np.pad(array, [(0, 0)] + [(0, int(size) - n) for size, n in zip(shape[1:], array.shape[1:])])
            for array in arrays
        ])
    return merged
