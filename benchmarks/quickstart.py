"""BLEU against training time: the Quick start's settings and the levers that might make it faster.

Every setting is the Quick start's (`keras_transformer/quickstart.py`) with
one or more levers changed (`SETTINGS` below). Two measurements:

- `speed`: updates per minute of each setting, from a short run
  (`--updates`, checkpoints every `--updates // 2`): the time between the
  middle and the last checkpoint's files, so start-up, vocabulary and
  tracing are left out and one validation-loss pass is in, as in training.
- `train` + `score`: one long run per setting, stopped after `--minutes`
  of wall clock (kill and resume are safe), checkpoints every 100 updates
  kept. Then, at every `--every` minutes t, the last 3 checkpoints written
  by t are averaged (what a Quick start that stopped at that update would
  average) and scored on the bundled test split with beam 4 (sacreBLEU, as
  `python -m keras_transformer.evaluate`). A checkpoint's time is its
  file's modification time minus the launch of the training command: the
  user's wall clock, with vocabulary training, data preparation, tracing
  and the validation loss after every 100 updates in it.

The runs are sequential and nothing else should run on the machine while
they train (scoring is not timed). One run per setting: how noisy that is
is said in benchmarks/README.md.

```
python -m benchmarks.quickstart speed quickstart bf16 xla
python -m benchmarks.quickstart train quickstart --minutes 45
python -m benchmarks.quickstart score quickstart --every 5
python -m benchmarks.quickstart plot          # results/quickstart.json + quickstart.png
```

Runs go to `runs/bench-quickstart/<setting>` (not committed); results to
`benchmarks/results/quickstart_<setting>.json`.
"""

import argparse
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

from keras_transformer.quickstart import SETTINGS as QUICKSTART

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs" / "bench-quickstart"
RETRIEVAL_BLEU = 14.53  # keras_transformer/datasets/libreoffice_en_de/README.md, test split
GOAL_BLEU = RETRIEVAL_BLEU + 10

SETTINGS = {
    "quickstart": {},
    "bf16": {"mixed_precision": "mixed_bfloat16"},
    "xla": {"jit_compile": True},
    "bf16_xla": {"mixed_precision": "mixed_bfloat16", "jit_compile": True},
    "lr1": {"learning_rate_scale": 1.0},
    "lr1_warmup200": {"learning_rate_scale": 1.0, "warmup_steps": 200},
    "batch8k": {"tokens_per_batch": 8192},
    "bf16_lr1": {"mixed_precision": "mixed_bfloat16", "learning_rate_scale": 1.0},
}
"""Levers on top of the Quick start's settings, by name."""

CHECKPOINT_RE = re.compile(r"ckpt-(\d+)\.weights\.h5")


def setting(name, **extra):
    """The training arguments of setting `name`: the Quick start's with its levers and `extra`."""
    if name not in SETTINGS:
        sys.exit(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
    return {**QUICKSTART, **SETTINGS[name], **extra}


def train_command(output, arguments):
    """`python -m keras_transformer.train` with `arguments` (a dict of run_training names)."""
    command = [sys.executable, "-m", "keras_transformer.train", "--output", str(output)]
    for key, value in arguments.items():
        if value is True:
            value = "true"
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def checkpoints(run_dir):
    """[(update, mtime, path)] of the checkpoints under `run_dir`, oldest first."""
    found = []
    for path in run_dir.rglob("ckpt-*.weights.h5"):
        match = CHECKPOINT_RE.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path.stat().st_mtime, path))
    return sorted(found)


def written_by(timeline, seconds, last):
    """The last `last` of `timeline`'s (update, seconds) checkpoints written by `seconds`, oldest first.

    Example:
    >>> written_by([(100, 200.0), (200, 400.0), (300, 600.0)], 500, last=3)
    [(100, 200.0), (200, 400.0)]
    """
    return [c for c in timeline if c[1] <= seconds][-last:]


def launch(name, output, arguments, minutes=None, done=None):
    """Runs the training command; stops it after `minutes` of wall clock or once `done()` is true.

    Returns (launch time, seconds, rc); a stopped run's rc is the signal's.
    """
    if output.exists():
        sys.exit(f"{output} exists; remove it to measure {name} again")
    output.parent.mkdir(parents=True, exist_ok=True)
    command = train_command(output, arguments)
    print(" ".join(command), flush=True)
    with open(output.parent / f"{name}.log", "w") as log:
        started = time.time()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = None if minutes is None else started + 60 * minutes
        while process.poll() is None:
            if (deadline is not None and time.time() >= deadline) or (done is not None and done()):
                process.terminate()  # resumable: the run can be continued with the same command
                break
            time.sleep(1.0)
        rc = process.wait()
    return started, time.time() - started, rc


def _machine():
    return {"machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def _write(name, result):
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"quickstart_{name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    previous.update(result)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(previous, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


def speed(names, updates):
    """Updates per minute of each setting between its middle and last checkpoint."""
    half = max(updates // 2, 1)
    for name in names:
        output = RUNS / f"speed-{name}"
        arguments = setting(name, steps=2 * half, checkpoint_every=half, keep_checkpoints=10, average_last=1)
        arguments.pop("epochs", None)
        # Stopped at the last checkpoint: the averaging and validation BLEU after it are not timed.
        started, seconds, rc = launch(f"speed-{name}", output, arguments,
                                      done=lambda: any(u == 2 * half for u, _, _ in checkpoints(output)))
        found = checkpoints(output)
        if len(found) < 2:
            print(f"{name}: training failed (rc {rc}); see {output.parent / ('speed-' + name + '.log')}")
            continue
        (first, t0, _), (last, t1, _) = found[0], found[-1]
        per_minute = 60 * (last - first) / (t1 - t0)
        print(f"{name}: {per_minute:.1f} updates/minute ({last - first} updates in {t1 - t0:.0f} s; "
              f"first checkpoint after {t0 - started:.0f} s)")
        _write(name, {"speed": {"arguments": arguments, "updates_per_minute": round(per_minute, 2),
                                "timed_updates": last - first, "timed_seconds": round(t1 - t0, 1),
                                "first_checkpoint_seconds": round(t0 - started, 1), **_machine()}})


def train(name, minutes):
    """One long run of setting `name`, stopped after `minutes`; records each checkpoint's time."""
    output = RUNS / name
    arguments = setting(name, keep_checkpoints=1000)
    started, seconds, rc = launch(name, output, arguments, minutes)
    found = checkpoints(output)
    timeline = [{"update": update, "seconds": round(mtime - started, 1)} for update, mtime, _ in found]
    print(f"{name}: {len(found)} checkpoints in {seconds / 60:.1f} minutes (rc {rc})")
    _write(name, {"train": {"arguments": arguments, "minutes_limit": minutes, "rc": rc,
                            "finished": (output / "config.json").exists(), "checkpoints": timeline,
                            **_machine()}})


def score(name, every, average_last, beam_size, max_minutes=None):
    """BLEU of the average of the last `average_last` checkpoints written by every `every` minutes."""
    import keras

    from keras_transformer import Tokenizer, TransformerModel, Translator
    from keras_transformer.datasets import load_bundled
    from keras_transformer.evaluate import evaluate
    from keras_transformer.training import average_checkpoints

    path = RESULTS / f"quickstart_{name}.json"
    recorded = json.loads(path.read_text())["train"]
    output = RUNS / name
    found = checkpoints(output)
    by_update = {update: p for update, _, p in found}
    timeline = [(c["update"], c["seconds"]) for c in recorded["checkpoints"] if c["update"] in by_update]
    tokenizer = Tokenizer.load(next(output.rglob("tokenizer.model")).parent)
    model = TransformerModel.from_preset(recorded["arguments"]["preset"],
                                         vocabulary_size=tokenizer.vocabulary_size, max_sequence_length=128)
    sources, references = load_bundled("test")
    points = []
    limit = max_minutes if max_minutes is not None else recorded["minutes_limit"]
    t = every
    while t <= limit + 1e-9:
        chosen = written_by(timeline, 60 * t, average_last)
        if chosen:
            averaged = RUNS / f"{name}-average.weights.h5"
            average_checkpoints([by_update[u] for u, _ in chosen], averaged)
            model.load_weights(str(averaged))
            started = time.time()
            result = evaluate(Translator(model, tokenizer), sources, references, beam_size=beam_size)
            point = {"minutes": t, "update": chosen[-1][0], "checkpoint_seconds": chosen[-1][1],
                     "averaged": [u for u, _ in chosen], "bleu": round(result["bleu"], 2),
                     "chrf": round(result["chrf"], 2), "score_seconds": round(time.time() - started, 1)}
            print(json.dumps(point), flush=True)
            points.append(point)
        t += every
    _write(name, {"score": {"every_minutes": every, "average_last": average_last, "beam_size": beam_size,
                            "split": "test", "sentences": len(sources), "backend": keras.backend.backend(),
                            "points": points, "bleu_signature": result["bleu_signature"]}})


def plot():
    """One figure: BLEU against training minutes for every scored setting; results/quickstart.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {}
    figure, (axis, by_update) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in sorted(RESULTS.glob("quickstart_*.json")):
        name = path.stem[len("quickstart_"):]
        result = json.loads(path.read_text())
        summary[name] = result
        points = result.get("score", {}).get("points")
        if points:
            bleu = [p["bleu"] for p in points]
            axis.plot([p["checkpoint_seconds"] / 60 for p in points], bleu, marker="o", label=name)
            by_update.plot([p["update"] for p in points], bleu, marker="o", label=name)
    for a in (axis, by_update):
        a.axhline(RETRIEVAL_BLEU, color="gray", linestyle=":", label=f"retrieval baseline ({RETRIEVAL_BLEU})")
        a.axhline(GOAL_BLEU, color="gray", linestyle="--", label=f"goal ({GOAL_BLEU:.1f})")
        a.set_ylabel("test BLEU (beam 4, average of the last 3 checkpoints)")
        a.grid(alpha=0.3)
    axis.axvline(45, color="red", linestyle="--", linewidth=0.8, label="45 minutes")
    axis.set_xlabel("wall-clock minutes since the training command started (2-core CPU)")
    axis.set_title("BLEU vs training time")
    by_update.set_xlabel("optimizer updates (4096-token batches)")
    by_update.set_title("BLEU vs updates (the same runs)")
    axis.legend(fontsize=8)
    figure.suptitle("Quick start (small preset, bundled English-German corpus), one run per setting")
    figure.tight_layout()
    figure.savefig(RESULTS / "quickstart.png", dpi=120)
    (RESULTS / "quickstart.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {RESULTS / 'quickstart.png'} and {RESULTS / 'quickstart.json'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("speed", help="updates per minute of each setting (short runs)")
    p.add_argument("names", nargs="+", choices=list(SETTINGS))
    p.add_argument("--updates", type=int, default=60)
    p = commands.add_parser("train", help="one long run, stopped after --minutes")
    p.add_argument("name", choices=list(SETTINGS))
    p.add_argument("--minutes", type=float, default=45)
    p = commands.add_parser("score", help="BLEU of the checkpoints written by every --every minutes")
    p.add_argument("name", choices=list(SETTINGS))
    p.add_argument("--every", type=float, default=5)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--average-last", type=int, default=QUICKSTART["average_last"])
    p.add_argument("--beam-size", type=int, default=4)
    commands.add_parser("plot", help="results/quickstart.png from every scored setting")
    args = parser.parse_args(argv)
    if args.command == "speed":
        speed(args.names, args.updates)
    elif args.command == "train":
        train(args.name, args.minutes)
    elif args.command == "score":
        score(args.name, args.every, args.average_last, args.beam_size, args.max_minutes)
    else:
        plot()


if __name__ == "__main__":
    main()
