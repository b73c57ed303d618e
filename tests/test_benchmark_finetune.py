"""benchmarks.finetune's arithmetic: FLOPs per step, the summary of measured steps, the table."""

import numpy as np

from benchmarks import finetune
from benchmarks.train import BENCH_SMALL, training_flops, transformer_training_flops


def test_training_flops_count_layers_output_projection_and_attention():
    # 1 encoder + 2 decoder layers, B=2, S=3, T=5, d=4, V=10, by hand:
    # layers 6 * (100 * 2 * 3 + 200 * 2 * 5) = 15,600; output 6 * 4 * 10 * 2 * 5 = 2,400;
    # attention 12 * 4 * 2 * (1 * 9 + 2 * (25 + 15)) = 8,544.
    flops = transformer_training_flops(100, 200, hidden_dim=4, vocabulary_size=10, num_encoder_layers=1,
                                       num_decoder_layers=2, batch_size=2, source_length=3, target_length=5)
    assert flops == 15_600 + 2_400 + 8_544
    # benchmarks.train's symmetric form is the same formula.
    b, n, d, v, layers = (BENCH_SMALL[k] for k in ("batch_size", "sequence_length", "hidden_dim",
                                                      "vocabulary_size", "num_layers"))
    assert training_flops(BENCH_SMALL, 1000, 2000) == (
        6 * (1000 + 2000) * b * n + 6 * d * v * b * n + 12 * d * layers * 3 * n * n * b
    )


def test_summary_counts_the_labels_of_the_batches_that_ran():
    labels = [np.array([[5, 6, 0], [7, 0, 0]]), np.array([[5, 6, 7], [8, 9, 4]])]  # 3 and 6 target tokens
    batches = [(None, None, y) for y in labels]
    measured = {"times": [1.0, 2.0, 3.0], "batches": [0, 1, 0], "system_seconds": [0.1, 0.4, 0.2],
                "minor_faults": [0, 2 * 2**20 // finetune.PAGE_BYTES, 2**30 // finetune.PAGE_BYTES]}
    summary = finetune.summarize(measured, batches, flops=[10.0, 40.0])
    assert summary["seconds_per_step"] == 2.0
    assert summary["target_tokens_per_second"] == (3 + 6 + 3) / 6.0
    assert summary["flops_per_second"] == (10 + 40 + 10) / 6.0
    # The kernel's share: medians of the steps' system time and of the memory they faulted in (2 MB).
    assert summary["system_seconds_per_step"] == 0.2
    assert summary["faulted_mb_per_step"] == 2.0


# One contender's figures, as `run_group` writes them.
_ROW = {"target_tokens_per_second": 1500.0, "ratio": 1.5, "seconds_per_step": 2.0, "flops_per_second": 50e9,
        "peak_rss_mb": 2048.0}


def test_table_gives_ratio_mfu_and_the_loss_difference():
    results = {
        "matmul_peak_gflops": 100.0,
        "groups": [{"shape": "base", "budget": 2000, "precision": "float32", "contenders": {
            "huggingface": dict(_ROW, ratio=1.0, target_tokens_per_second=1000.0, system_seconds_per_step=0.37,
                                faulted_mb_per_step=614.4),
            "torch": _ROW,  # measured before the system time and Hugging Face alone were: "-", no second ratio
            "jax": dict(_ROW, ratio_to_huggingface_alone=1.25),
            finetune.ALONE: dict(_ROW, ratio=1.0, target_tokens_per_second=1200.0, seconds_per_step=1.6)}}],
        "checks": {"base": {"max_abs_difference": {"torch": 1.9e-4}}},
    }
    lines = finetune.table(results).splitlines()
    assert lines[2] == ("| base | 2000 | float32 | huggingface | 1,000 | 1.00x | 2.000 | 50% | 0.37 (0.6) | 2,048 | "
                        "reference |")
    assert lines[3] == ("| base | 2000 | float32 | huggingface alone | 1,200 | 1.00x | 1.600 | 50% | - | 2,048 | "
                        "reference |")
    assert lines[4] == "| base | 2000 | float32 | jax | 1,500 | 1.50x (1.25x) | 2.000 | 50% | - | 2,048 | - |"
    assert lines[5] == "| base | 2000 | float32 | torch | 1,500 | 1.50x | 2.000 | 50% | - | 2,048 | 1.9e-04 |"


def test_table_puts_a_baseline_row_after_its_backend():
    results = {
        "matmul_peak_gflops": 100.0,
        "groups": [{"shape": "small", "budget": 8000, "precision": "float32", "contenders": {
            "huggingface": dict(_ROW, ratio=1.0, target_tokens_per_second=1000.0),
            "jax@baseline": dict(_ROW, ratio=1.2, seconds_per_step=2.5), "jax": _ROW}}],
        "checks": {},
    }
    names = [line.split(" | ")[3] for line in finetune.table(results).splitlines()[2:]]
    assert names == ["huggingface", "jax", "jax@baseline"]


def test_baseline_must_be_a_second_checkout(tmp_path, capsys):
    import pytest

    for directory, message in ((tmp_path, "not a checkout of this repository"),
                               (finetune.ROOT, "that is this checkout")):
        with pytest.raises(SystemExit):
            finetune.main(["--baseline", str(directory), "--shapes", "small", "--budgets", "2000"])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error and "git worktree add" in error


def test_the_baseline_reads_the_same_batches_and_keeps_a_directory_of_its_own(tmp_path, monkeypatch):
    work = tmp_path / "ours" / "runs" / "bench-finetune"
    work.mkdir(parents=True)
    monkeypatch.setattr(finetune, "WORK", work)
    finetune._share_work(tmp_path / "before")
    assert (tmp_path / "before" / "runs" / "bench-finetune").resolve() == work.resolve()
    kept = tmp_path / "other" / "runs" / "bench-finetune"
    kept.mkdir(parents=True)
    (kept / "mine").write_text("x")
    finetune._share_work(tmp_path / "other")
    assert not kept.is_symlink() and (kept / "mine").read_text() == "x"


def test_set_random_seed_seeds_as_keras_does_without_importing_tensorflow_on_jax_and_torch():
    import os
    import subprocess
    import sys

    script = (
        "import sys, random, numpy as np, keras\n"
        "from benchmarks import finetune\n"
        "finetune.set_random_seed(7); ours = (random.random(), np.random.random())\n"
        "loaded = 'tensorflow' in sys.modules\n"
        "keras.utils.set_random_seed(7); theirs = (random.random(), np.random.random())\n"
        "print(loaded, ours == theirs)"
    )
    for backend in ("jax", "torch"):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, KERAS_BACKEND=backend))
        assert result.stdout.split() == ["False", "True"], (backend, result.stderr[-2000:])
