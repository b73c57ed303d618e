"""The contract's graphs as TensorFlow functions of a Keras model, for both exporters.

`graph_functions(model)` wraps each method of the decoding protocol
(`TransformerModel.encode`, `init_cache`, `decode_step`) and the whole
search (`generation.search_graph`) as a Python function of the graph's
inputs, with its `tf.TensorSpec` input signature generated from
`export.contract`: `export/onnx.py` converts these functions with tf2onnx,
`export/saved_model.py` saves the protocol ones as signatures. Runs on the
TensorFlow backend.
"""

import inspect

from keras import ops

from export import contract
from keras_transformer.generation import hypotheses_graph, search_graph, start_graph, update_graph
from keras_transformer.search.loop import SEARCHES

_HYPOTHESES_OUTPUTS = ("sequences", "scores", "log_probs")


def input_signature(graph, model):
    """`[tf.TensorSpec]` of the graph's inputs, in order, named, for `model`'s sizes and dtype."""
    import tensorflow as tf

    sizes = contract.model_fields(model)
    return [
        tf.TensorSpec(contract.shape(t, sizes), tf.as_dtype(contract.dtype(t, model.compute_dtype)), name=t.name)
        for t in graph.inputs
    ]


def graph_functions(model, names=None):
    """`{ONNX graph name: (function, input signature)}` for the graphs `names` of `contract.ONNX`.

    Each function takes the graph's inputs (by position, in the contract's
    order) and returns a dict of its outputs by name. `names`: default,
    every graph converted from TensorFlow (all but `fused_decoder_step`,
    which `export/fused_step.py` builds).
    """

    def encoder(encoder_token_ids):
        return {"encoder_outputs": model.encode(encoder_token_ids, training=False)}

    def init_cache(encoder_outputs, encoder_token_ids, max_length):
        return dict(model.init_cache(encoder_outputs, encoder_token_ids, max_length))

    def decoder_step(decoder_token_ids, step, self_key, self_value, cross_key, cross_value, encoder_padding_mask):
        cache = {
            "self_key": self_key, "self_value": self_value, "cross_key": cross_key, "cross_value": cross_value,
            "encoder_padding_mask": encoder_padding_mask,
        }
        logits, cache = model.decode_step(decoder_token_ids, step, cache)
        return {"logits": logits, "updated_self_key": cache["self_key"], "updated_self_value": cache["self_value"]}

    greedy, beam = search_graph(model, "greedy"), search_graph(model, "beam")

    def greedy_search(encoder_token_ids, alpha, max_extra_length):
        return dict(zip(("sequences", "scores"), greedy(encoder_token_ids, 1, alpha, max_extra_length)))

    def beam_search(encoder_token_ids, beam_size, alpha, max_extra_length):
        return dict(zip(("sequences", "scores"), beam(encoder_token_ids, beam_size, alpha, max_extra_length)))

    beam_n_best, sample = hypotheses_graph(model, "beam"), hypotheses_graph(model, "sample")

    def beam_hypotheses(
        encoder_token_ids, target_prefix, beam_size, num_hypotheses, ended_to_stop, alpha, max_extra_length
    ):
        options = {"target_prefix": target_prefix, "num_hypotheses": num_hypotheses, "ended_to_stop": ended_to_stop}
        outputs = beam_n_best(encoder_token_ids, beam_size, alpha, max_extra_length, options)
        return dict(zip(_HYPOTHESES_OUTPUTS, outputs))

    def sample_search(
        encoder_token_ids, target_prefix, sample_key, seed, sampling_topk, sampling_topp, sampling_temperature,
        alpha, max_extra_length,
    ):
        options = {
            "target_prefix": target_prefix, "sample_key": sample_key, "seed": seed,
            "sampling_topk": sampling_topk, "sampling_topp": sampling_topp,
            "sampling_temperature": sampling_temperature,
        }
        outputs = sample(encoder_token_ids, 1, alpha, max_extra_length, options)
        return dict(zip(_HYPOTHESES_OUTPUTS, (output[:, 0] for output in outputs)))

    functions = {
        "encoder": encoder, "init_cache": init_cache, "decoder_step": decoder_step,
        "greedy_search": greedy_search, "beam_search": beam_search,
        "beam_hypotheses": beam_hypotheses, "sample_search": sample_search,
    }
    for search_name, (start_name, update_name) in contract.STEP_GRAPHS.items():
        functions.setdefault(start_name, _start_function(model, search_name, contract.ONNX.graphs[start_name]))
        functions[update_name] = _update_function(model, search_name, contract.ONNX.graphs[update_name])
    signatures = {}
    for name in functions if names is None else names:
        function, graph = functions[name], contract.ONNX.graphs[name]
        # Traced by position: the parameters must be the contract's inputs, in its order.
        if list(inspect.signature(function).parameters) != graph.input_names():
            raise AssertionError(f"{name} takes {list(inspect.signature(function).parameters)}; "
                                 f"the contract says {graph.input_names()}")
        signatures[name] = (function, input_signature(graph, model))
    return signatures


def _by_name(graph, body):
    """A function of the graph's inputs by position (named as the contract's) calling `body({name: tensor})`."""

    def function(*tensors):
        return body(dict(zip(graph.input_names(), tensors)))

    function.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in graph.input_names()]
    )
    return function


def check_state_tensors(search_name, graph):
    """Checks that an update graph's state inputs are the search's `STATE_SPEC` (names, dtypes, axes)."""
    tensors = {tensor.name: tensor for tensor in graph.inputs}
    for field in SEARCHES[search_name].STATE_SPEC:
        tensor = tensors.get(field.name)
        axes = tuple(contract.STATE_AXES[axis] for axis in field.axes)
        if tensor is None or tensor.dtype != field.dtype or tensor.axes != axes:
            raise AssertionError(
                f"{search_name}'s state field {field} is {tensor} in the contract; expected {field.dtype} {axes}"
            )


def _start_function(model, search_name, graph):
    """`generation.start_graph` with the contract's inputs and outputs."""
    start = start_graph(model, search_name)

    def body(inputs):
        outputs = start(
            inputs["encoder_token_ids"], inputs.get("beam_size", 1), inputs["max_extra_length"],
            {"target_prefix": inputs["target_prefix"]},
        )
        return {name: outputs[name] for name in graph.output_names()}

    return _by_name(graph, body)


def _update_function(model, search_name, graph):
    """`generation.update_graph` with the contract's inputs and outputs (`updated_*`, `hypotheses_*`)."""
    check_state_tensors(search_name, graph)
    update = update_graph(model, search_name)
    state_names = [field.name for field in SEARCHES[search_name].STATE_SPEC]
    outputs_by_name = {tensor.name: tensor for tensor in graph.outputs}

    def body(inputs):
        outputs = update(
            {name: inputs[name] for name in state_names}, inputs["logits"], inputs["max_lengths"], inputs["alpha"],
            inputs["buffer_length"],
        )
        named = {f"updated_{name}": value for name, value in outputs["state"].items()}
        for name, value in zip(_HYPOTHESES_OUTPUTS, outputs["hypotheses"]):
            tensor = outputs_by_name[f"hypotheses_{name}"]
            # Sampling's update graph drops the hypotheses axis of size 1 (the contract says which).
            named[f"hypotheses_{name}"] = value if "hypotheses" in tensor.axes else ops.squeeze(value, 1)
        named.update({name: outputs[name] for name in ("decoder_token_ids", "rows_done", "keep_going", "parents")
                      if name in outputs})
        return {name: named[name] for name in graph.output_names()}

    return _by_name(graph, body)
