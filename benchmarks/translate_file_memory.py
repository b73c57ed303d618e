"""Memory of `Translator.translate_file` against the length of the file: it should stay flat.

`translate_file` streams its input: it reads `--window` lines, sorts them by
length into batches, writes their translations and reads on, so its memory
is bounded by the window, not by the file. This measures it: files of
`--lines` lines (default 20,000 and 200,000, the bundled training corpus'
English lines repeated) are translated, each in a fresh process, and each
process reports its peak resident memory (`VmHWM`) after setting up the
translator and at the end; the growth between the two is the streaming's.

What is measured is the streaming, not a model, so the default engine is a
stand-in (`--engine copy`): a decoding-protocol object whose `generate`
returns the source ids (the tokenizer's encoding and decoding, the batching,
the ordering and the writing all run as with a real model, in a fraction of
the time). `--engine onnx --model DIR` uses `export.runtime.OnnxTranslator`
on an exported model instead (greedy search, `--max-extra-length` tokens).
`--in-memory` measures, for contrast, what streaming avoids: the whole file
read into a list, `translate`d and written (memory that grows with the file).

```
python -m benchmarks.translate_file_memory                       # ~1 min on a 2-core CPU
python -m benchmarks.translate_file_memory --lines 20000 200000 --window 10000 --json out.json
python -m benchmarks.translate_file_memory --in-memory                 # the contrast: read, translate, write
python -m benchmarks.translate_file_memory --engine onnx --model runs/small-onnx --lines 2000 20000
```

Prints one line per file and a JSON summary (also written to `--json`).
"""

if not __package__:
    raise SystemExit("Run as a module from the repository root: python -m benchmarks.translate_file_memory")

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_LINES = (20_000, 200_000)
VOCABULARY_SIZE = 2000


class CopyEngine:
    """A decoding-protocol stand-in whose search returns the source: start id, the source ids (end included)."""

    pad_id, unk_id, start_id, end_id = 0, 1, 2, 3

    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size

    def generate(self, encoder_token_ids, beam_size=4, length_penalty=0.6, max_extra_length=50):
        import numpy as np

        ids = np.asarray(encoder_token_ids, np.int32)
        return np.concatenate([np.full((ids.shape[0], 1), self.start_id, np.int32), ids], axis=1)


def peak_rss_mb():
    """This process' peak resident memory (`VmHWM`, Linux) in MB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def rss_mb():
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def reset_peak_rss():
    """Resets `VmHWM` to the current RSS (Linux >= 4.0: `clear_refs` 5); False where not allowed."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def write_corpus(path, lines):
    """`lines` lines cycled from the bundled training corpus' English side, plain UTF-8."""
    from keras_transformer.datasets import bundled_paths
    from keras_transformer.textio import iter_lines

    source = [line for line in iter_lines(bundled_paths("train")[0])]
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in itertools.islice(itertools.cycle(source), lines):
            f.write(line + "\n")


def worker(args):
    """One measurement in this process: prints a JSON line."""
    from keras_transformer.tokenizers.sentencepiece import load_tokenizer
    from keras_transformer.translator import Translator

    if args.engine == "copy":
        tokenizer = load_tokenizer(args.tokenizer)
        translator = Translator(CopyEngine(tokenizer.vocabulary_size), tokenizer)
    else:
        from export.runtime import OnnxTranslator

        translator = OnnxTranslator(args.model, providers=["CPUExecutionProvider"], intra_op_threads=1)
    setup_peak, setup_rss = peak_rss_mb(), rss_mb()
    reset = reset_peak_rss()
    start = time.perf_counter()
    search = dict(beam_size=1, max_extra_length=args.max_extra_length, max_batch_tokens=args.max_batch_tokens)
    if args.in_memory:
        from keras_transformer.textio import read_lines, write_lines

        written = write_lines(args.output, translator.translate(read_lines(args.src), **search), overwrite=True)
    else:
        written = translator.translate_file(args.src, args.output, window=args.window, overwrite=True, **search)
    seconds = time.perf_counter() - start
    peak = peak_rss_mb()
    print(json.dumps({
        "lines": written, "seconds": round(seconds, 2), "sentences_per_second": round(written / seconds, 1),
        "rss_after_setup_mb": round(setup_rss, 1), "peak_rss_setup_mb": round(setup_peak, 1),
        "peak_rss_translating_mb": round(peak, 1), "peak_reset": reset,
        "growth_mb": round(peak - setup_rss, 1),
    }))


def measure(lines_list, engine="copy", model=None, window=10_000, max_batch_tokens=4096, max_extra_length=2,
            work=None, in_memory=False):
    """Runs one worker process per line count; returns their reports (dicts), in order."""
    reports = []
    with tempfile.TemporaryDirectory(dir=work) as directory:
        directory = pathlib.Path(directory)
        tokenizer_dir = directory / "tokenizer"
        if engine == "copy":
            from keras_transformer.datasets import bundled_paths
            from keras_transformer.tokenizers.sentencepiece import train_tokenizer

            train_tokenizer(list(bundled_paths("train")), vocabulary_size=VOCABULARY_SIZE).save(tokenizer_dir)
        for lines in lines_list:
            src = directory / f"corpus-{lines}.en"
            write_corpus(src, lines)
            command = [
                sys.executable, "-m", "benchmarks.translate_file_memory", "--worker", "--engine", engine,
                "--src", str(src), "--output", str(directory / f"out-{lines}.de"), "--tokenizer", str(tokenizer_dir),
                "--window", str(window), "--max-batch-tokens", str(max_batch_tokens),
                "--max-extra-length", str(max_extra_length),
            ] + (["--model", str(model)] if model else []) + (["--in-memory"] if in_memory else [])
            result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
            if result.returncode != 0:
                raise RuntimeError(f"the worker for {lines} lines failed ({result.returncode}):\n{result.stderr}")
            report = json.loads(result.stdout.strip().splitlines()[-1])
            report["file_mb"] = round(src.stat().st_size / 2**20, 1)
            reports.append(report)
            src.unlink()
    return reports


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.translate_file_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--lines", type=int, nargs="+", default=list(DEFAULT_LINES), help="file lengths to measure")
    parser.add_argument("--engine", choices=("copy", "onnx"), default="copy")
    parser.add_argument("--model", help="an ONNX export (python -m export.onnx), for --engine onnx")
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-extra-length", type=int, default=2)
    parser.add_argument("--in-memory", action="store_true", help="read the whole file and translate() it, for contrast")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--work", help="directory for the temporary files (default: the system's)")
    # The worker's own arguments.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.engine == "onnx" and not args.model:
        parser.error("--engine onnx needs --model DIR")
    reports = measure(args.lines, args.engine, args.model, args.window, args.max_batch_tokens,
                      args.max_extra_length, args.work, args.in_memory)
    for report in reports:
        print(f"{report['lines']:>8} lines ({report['file_mb']} MB): peak RSS {report['peak_rss_translating_mb']} MB "
              f"(after setup {report['rss_after_setup_mb']} MB, growth {report['growth_mb']} MB), "
              f"{report['sentences_per_second']} sentences/s")
    summary = {"engine": args.engine, "mode": "in_memory" if args.in_memory else "translate_file",
               "window": args.window, "max_batch_tokens": args.max_batch_tokens, "reports": reports}
    print(json.dumps(summary, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
