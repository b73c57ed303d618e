"""A `Translator` call's search: its `SearchOptions`, and the arguments of the model's own search methods.

No framework is imported here (the ONNX Runtime server uses it).
"""

import inspect

from keras_transformer.search.options import FIELDS, ONE_PER_SOURCE, call_options, refuse_hypotheses
from keras_transformer.translation.batching import check_batch_limits


def search_options(method, options, keywords, batch_size, max_batch_tokens):
    """The call's `SearchOptions` (`call_options`: `options` or its keywords), its batch limits checked after them.

    A `translate*` call other than `translate_hypotheses` gives one output per text: no `num_hypotheses`.
    """
    one_per_text = method != "translate_hypotheses"
    options = call_options(method, options, keywords, ONE_PER_SOURCE if one_per_text else FIELDS)
    check_batch_limits(batch_size, max_batch_tokens)
    if one_per_text:
        refuse_hypotheses(options, "translate", "translate_hypotheses")
    return options


def model_search_args(method, options, cancelled=None, finished=None):
    """The search arguments of a model's own `generate` or `generate_hypotheses`.

    `options=` when the method takes it (`TransformerModel`,
    `OnnxSeq2Seq`), else its keywords (`SearchOptions.search_args`: a
    decoding-protocol object of its own, which may take only some);
    `cancelled=` and `finished=` when given and the method takes them (`OnnxSeq2Seq`).
    """
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        parameters = {}

    def takes(name):
        return name in parameters and parameters[name].kind != inspect.Parameter.VAR_KEYWORD

    args = {"options": options} if takes("options") else options.search_args()
    for name, given in (("cancelled", cancelled), ("finished", finished)):
        if given is not None and takes(name):
            args[name] = given
    return args


def generate_ids(model, ids, options, cancelled=None, finished=None):
    """One output per row of `ids`: the model's own `generate`, or `generation.generate` over its protocol."""
    generate = getattr(model, "generate", None)
    if callable(generate):
        return generate(ids, **model_search_args(generate, options, cancelled, finished))
    from keras_transformer.generation import generate

    return generate(model, ids, options=options)


def generate_hypotheses(model, ids, options, target_prefix, cancelled=None, finished=None):
    """`options.count` outputs per row: the model's own `generate_hypotheses`, or `generation`'s over its protocol."""
    method = getattr(model, "generate_hypotheses", None)
    if callable(method):
        args = model_search_args(method, options, cancelled, finished)
        if "options" not in args:
            args.update(num_hypotheses=options.count)
        return method(ids, target_prefix=target_prefix, **args)
    from keras_transformer.generation import generate_hypotheses

    return generate_hypotheses(model, ids, target_prefix=target_prefix, options=options)
