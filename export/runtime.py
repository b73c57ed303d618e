"""ONNX Runtime inference for a directory written by `python -m export.onnx`.

A serving process needs no training framework: this module imports
onnxruntime, NumPy, SentencePiece and the framework-free parts of this
package (`keras_transformer.decoding`, `.tokenizer`, `.marian_tokenizer`,
`.translator`, `.search.scoring`, `.textio`, the file options of
`.translate`), never Keras, TensorFlow, JAX or PyTorch (a test runs it where
importing them fails). `pip install "keras-aiayn[serve]"` installs just that
(`[serve-gpu]` for CUDA).

`OnnxSeq2Seq.generate` and `generate_hypotheses` run the Keras search
itself, converted: the exported `<search>_start` graph (lengths, encoder,
the source's cache, the search's `init`) once, then per step the fused
decoder step (`export/fused_step.py`: contrib ops, the cache written in
place) and the `<search>_update` graph (search update, `rows_done`,
`hypotheses`) from a Python loop (`export.steps`) that takes the rows that
are done out of the batch, handing out their hypotheses, and grows the
self-attention cache with the output (as CTranslate2 does): a batch costs
the steps of its rows, not of its longest row times its size. The same
tokens as `TransformerModel.generate`.
The whole-search graphs (`greedy_search`, `beam_search`, ...: an ONNX `Loop`
over every row until the longest is done) remain for runtimes without
Python (`translate.onnx`) and `driver="whole"`. `encode`, `init_cache` and
`decode_step` run the protocol graphs for callers with a search of their
own. `OnnxTranslator` adds the tokenizer stored in the
directory (ours, or an imported Marian or NLLB-200 checkpoint's): text in,
text out; a multilingual (NLLB-200) model's languages are named per call
(`source_language=`, `target_language=`), as on `Translator`.

Example:

```python
from export.runtime import OnnxSeq2Seq, OnnxTranslator

model = OnnxSeq2Seq("exported/onnx")        # CUDA when it works, else CPU
ids = model.generate(src_ids, beam_size=4)  # same tokens as TransformerModel.generate
best = model.generate_hypotheses(src_ids, beam_size=4, num_hypotheses=3)   # as generation.generate_hypotheses
translator = OnnxTranslator("exported/onnx")
translator.translate(["A sentence."])
translator.translate_hypotheses(["A sentence."], num_hypotheses=2)    # [[Hypothesis(text, ...), ...]]
translator.translate_hypotheses(["A sentence."], return_alignment=True)  # .alignment, .word_alignment as on Keras
translator.translate(["A sentence."], target_prefix=["Ein"])
translator.translate(["A sentence."], beam_size=1, sampling_topk=10, seed=1)
translator.score(["A sentence."], ["Ein Satz."])   # teacher-forced log-probabilities, as on Keras
translator.translate_file("test.en.gz", "test.de", max_batch_tokens=4096)
OnnxTranslator("exported/nllb").translate(["A sentence."], source_language="eng_Latn", target_language="fra_Latn")
```

```
echo "A sentence." | python -m export.runtime --model exported/onnx --beam-size 4
echo "A sentence." | python -m export.runtime --model exported/nllb --source-language eng_Latn --target-language fra_Latn
python -m export.runtime --model exported/onnx --src test.en.gz --output test.de --max-batch-tokens 4096
```
"""

import argparse
import logging
import os
import sys

if __name__ == "__main__":
    # A command, not an import: NumPy's OpenBLAS starts a thread (and its
    # buffers) per core when NumPy loads, a large part of a one-sentence cold
    # start, and the server does no BLAS work in NumPy (the graphs run in ONNX
    # Runtime, with their own threads). A value the user has set is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# `OnnxSeq2Seq` lives in `export.runtime_model`, `OnnxTranslator` in `export.runtime_translator`, reading an
# export and opening its sessions in `export.runtime_sessions`; the names below stay importable from here (plain
# re-exports).
from export.runtime_model import OnnxSeq2Seq, _check_ids, _collected, _repeated, _to_numpy  # noqa: E402, F401
from export.runtime_sessions import (  # noqa: E402, F401
    _PROVIDER_WORKS, CACHE_KEYS, CPU, CUDA, DISABLED_OPTIMIZERS, OptimizedGraphCache, _provider_works,
    _session_options, add_optimized_cache_arguments, default_optimized_cache, new_session, optimized_cache,
    read_config, resolve_providers,
)
from export.runtime_translator import OnnxTranslator  # noqa: E402, F401
from keras_transformer.translate import (  # noqa: E402
    add_file_arguments,
    add_language_arguments,
    add_search_arguments,
    check_file_arguments,
    search_options,
    translate_lines,
)

logger = logging.getLogger("export.runtime")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m export.runtime",
        description="Translate one sentence per line (stdin or --src to stdout or --output) with an exported "
                    "ONNX model, streaming: a file of any size translates in bounded memory.",
    )
    parser.add_argument("--model", required=True, help="directory written by `python -m export.onnx`")
    add_search_arguments(parser)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="ONNX Runtime threads per session (default: one per core; 1 on a busy machine)",
    )
    add_optimized_cache_arguments(parser)
    add_file_arguments(parser)
    add_language_arguments(parser)
    parser.add_argument("--verbose", action="store_true", help="show ONNX Runtime's provider choice")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, received {args.threads}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        check_file_arguments(args)
        options = search_options(args)  # before loading the model: a bad value is refused at once, in one line
        translator = OnnxTranslator(args.model, intra_op_threads=args.threads, optimized_cache=optimized_cache(args))
        translator = translator.with_languages(args.source_language, args.target_language)
        # Empty lines translate to empty lines, so the output lines up with the input.
        count = translate_lines(translator, args, options=options)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.output is not None:
        print(f"Wrote {count} lines to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
