"""The step driver: a search's exported start and step graphs run from a Python loop.

`step_search` runs a `decoding.hypotheses_plan` with the search's
`<search>_start` graph (lengths, encoder, cache, the search's `init`) once and
its `<search>_step` graph (decoder step, search update, `rows_done`,
`keep_going`, `hypotheses`) per step (`run_steps`). Rows that are done leave
the batch and the self-attention cache grows with the output, as
CTranslate2 does: a batch costs the steps of its own rows, not its longest
row's steps times its size. The search's logic is the graphs' (the Keras
search, converted); this loop only moves arrays, by the contract's axis
names.

Framework-free (NumPy and `export.contract`): the ONNX Runtime server
(`export/runtime.py`) and the export's validation (`export/validate.py`)
run it.
"""

import numpy as np

from export import contract

# The step driver's first self-attention cache length; doubled (up to the
# output buffer length) whenever the output reaches it.
INITIAL_CACHE_LENGTH = 16
# `OnnxSeq2Seq(driver=...)`: this module's loop, or the whole-search graphs.
DRIVERS = ("steps", "whole")
_HYPOTHESES = ("sequences", "scores", "log_probs")


def run_steps(step, graph, values):
    """Runs a search's step graph until every row is done; rows that are done leave the batch.

    After each step, the rows that `rows_done` marks (all rows once
    `keep_going` is false) hand out their hypotheses, which no longer
    change, and every input with a batch axis (the contract's axis names:
    `batch`, one row per source; `beam_rows`, rows `b * K ... b * K + K - 1`
    of the cache) keeps the other rows only. Before a step at index i, a
    self-attention cache of i positions or fewer is grown (zeros on its
    `cache_length` axis, doubled, at most `buffer_length`). The search's
    logic is the graph's; this loop only moves arrays.

    Rows leave as soon as they are done: letting them wait in the batch
    until a fifth of it is done (fewer copies of the cache, more rows per
    step) was no faster at batch 16 and 64 (benchmarks/README.md).

    Args:
        step: `{input name: array} -> {output name: array}`, one run of `graph`.
        graph: the step graph's `contract.Graph` (`beam_step`, `sample_step`).
        values: `{name: array}`, every input of `graph` (from the start graph).

    Returns:
        `(sequences [B, K, L], scores [B, K], log_probs [B, K])` NumPy arrays,
        each row's hypotheses at its place in the batch (K = 1 where the
        graph's outputs have no `hypotheses` axis).
    """
    values = {name: values[name] for name in graph.input_names()}
    batch = len(values["max_lengths"])
    places = np.arange(batch)  # each live row's place in the batch
    cache_axes = {tensor.name: tensor.axes.index("cache_length") for tensor in graph.inputs
                  if "cache_length" in tensor.axes}
    buffer_length = int(values["buffer_length"])
    outputs_by_name = {tensor.name: tensor for tensor in graph.outputs}
    hypotheses_axes = {f"hypotheses_{name}": outputs_by_name[f"hypotheses_{name}"].axes for name in _HYPOTHESES}
    results = None
    while True:
        index = int(values["index"])
        for name, axis in cache_axes.items():
            length = values[name].shape[axis]
            if index >= length:
                padding = [(0, 0)] * values[name].ndim
                padding[axis] = (0, min(max(2 * length, index + 1), buffer_length) - length)
                values[name] = np.pad(values[name], padding)
        outputs = step(values)
        for name, value in outputs.items():
            if name.startswith("updated_"):
                values[name.removeprefix("updated_")] = value
        hypotheses = [
            outputs[name] if "hypotheses" in axes else np.expand_dims(outputs[name], 1)
            for name, axes in hypotheses_axes.items()
        ]
        if results is None:
            results = [np.zeros((batch, *x.shape[1:]), x.dtype) for x in hypotheses]
        keep_going = bool(outputs["keep_going"])
        done = np.asarray(outputs["rows_done"], bool) if keep_going else np.ones(len(places), bool)
        if done.any():
            for result, x in zip(results, hypotheses):
                result[places[done]] = x[done]
        if not keep_going:
            return tuple(results)
        if done.any():
            live = ~done
            places = places[live]
            beams = values["self_key"].shape[0] // len(live)
            live_rows = np.repeat(live, beams)
            for tensor in graph.inputs:
                if tensor.axes[:1] == ("batch",):
                    values[tensor.name] = values[tensor.name][live]
                elif tensor.axes[:1] == ("beam_rows",):
                    values[tensor.name] = values[tensor.name][live_rows]


def step_search(run, plan, length_penalty, max_extra_length, initial_cache_length=None):
    """Runs a `decoding.hypotheses_plan` with its search's start and step graphs.

    Args:
        run: `(graph name, {input name: value}) -> {output name: array}`.
        plan: a `decoding.HypothesesPlan`; its search's graphs are
            `contract.STEP_GRAPHS[plan.search_name]`.
        length_penalty, max_extra_length: as `generate_hypotheses`.
        initial_cache_length: the self-attention cache's first length
            (default `INITIAL_CACHE_LENGTH`).

    Returns:
        `(sequences [B, K, L], scores [B, K], log_probs [B, K])`, as the
        whole-search graph of the plan returns them.
    """
    _, values = contract.hypotheses_feeds(plan, length_penalty, max_extra_length)
    start_name, step_name = contract.STEP_GRAPHS[plan.search_name]
    start, step = contract.ONNX.graphs[start_name], contract.ONNX.graphs[step_name]
    values = dict(values, cache_length=initial_cache_length or INITIAL_CACHE_LENGTH)
    values.update(run(start_name, {name: values[name] for name in start.input_names()}))
    return run_steps(lambda feeds: run(step_name, feeds), step, values)
