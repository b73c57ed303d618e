"""The serving benchmark's own measuring and bookkeeping (`benchmarks/serve.py`), without models.

The benchmark itself runs for minutes (`python -m benchmarks.serve --quick`
is its smoke run); these check the parts whose mistakes would go unnoticed
in its output: token counting, memory and cold-start measurement, ratios
and goals.
"""

import sys
import types

import numpy as np
import pytest

serve = pytest.importorskip("benchmarks.serve")


def test_id_batch_appends_the_end_id():
    batch = serve.id_batch([[5, 6, 7], [8, 9, 10]], end_id=3)
    np.testing.assert_array_equal(batch, [[5, 6, 7, 3], [8, 9, 10, 3]])
    assert batch.dtype == np.int32


def test_generated_tokens_drop_start_end_and_padding():
    # As generate returns them: start id 2, tokens, end id 3, then padding.
    rows = np.array([[2, 7, 8, 3, 0], [2, 9, 3, 0, 0], [2, 4, 5, 6, 7]])
    assert serve.generated_tokens(rows, start_id=2, end_id=3) == [[7, 8], [9], [4, 5, 6, 7]]


def test_cold_start_reports_the_childs_memory_not_the_parents(tmp_path):
    # ru_maxrss of a child includes the parent's peak, carried across fork
    # and exec; the launcher must keep the benchmark's size out of it.
    ballast = np.ones(400 * 2**20 // 8)  # 400 MB, touched
    assert ballast.sum() > 0
    result = serve.cold_start(
        [sys.executable, "-c", "import sys; print(sys.stdin.readline().strip().upper())"],
        env=None, text="a sentence", log=tmp_path / "log",
    )
    assert result["output"] == "A SENTENCE"
    assert 0 < result["seconds"] < 30
    assert result["peak_rss_mb"] < 100
    big = serve.cold_start(
        [sys.executable, "-c", "import sys; b = bytearray(300 * 2**20); print(len(b))"],
        env=None, text="", log=tmp_path / "log",
    )
    assert 300 < big["peak_rss_mb"] < 390


def test_cold_start_failure_names_the_exit_status_and_stderr(tmp_path):
    command = [sys.executable, "-c", "import sys; sys.stderr.write('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="(?s)exit 3.*no model here"):
        serve.cold_start(command, env=None, text="x", log=tmp_path / "log")


def _workers():
    names = ("keras", "ort-float32", "ort-int8", "ct2-float32", "ct2-int8")
    return {f"{n}@1": types.SimpleNamespace(system_name=n, threads=1) for n in names}


def test_summary_ratios_and_goals():
    seconds = {"keras": 0.32, "ort-float32": 0.2, "ort-int8": 0.1, "ct2-float32": 0.1, "ct2-int8": 0.08}
    measured, calls = {}, {}
    for name, worker in _workers().items():
        for batch, search in ((1, "greedy"), (16, "beam4")):
            factor = 1 if batch == 1 else 4
            measured[name, batch, search] = {
                "seconds": [seconds[worker.system_name] * factor] * 3, "cpu": [1.0] * 3,
                "cpu_seconds": [seconds[worker.system_name] * factor / 2] * 3,
                "tokens": [[5] * 10] * batch,
            }
            calls[name, batch, search] = 1
    rows = serve.summarize(measured, calls, _workers())
    row = next(r for r in rows if (r["system"], r["batch"]) == ("ort-float32", 1))
    assert row["speedup_vs_keras"] == pytest.approx(1.6)
    assert row["time_over_ct2"] == pytest.approx(2.0)
    assert row["ms_per_token"] == pytest.approx(20.0)  # 0.2 s / 10 tokens
    assert row["cpu_ms_per_token"] == pytest.approx(10.0)
    big = next(r for r in rows if (r["system"], r["batch"]) == ("ct2-int8", 16))
    assert big["sentences_per_second"] == pytest.approx(16 / 0.32)
    assert big["ms_per_token"] == pytest.approx(1e3 * 0.32 / 160)

    cold = [{"path": "ort", "seconds": 0.5, "peak_rss_mb": 250.0}]
    checks = {c["goal"]: c["met"] for c in serve.goals(rows, cold)}
    assert checks["ORT float32 vs Keras/XLA, batch 1 greedy"] is True  # 1.6x
    assert checks["ORT float32 vs Keras/XLA, batch 16 beam4"] is True
    assert checks["ort-float32 time / ct2-float32 time (worst setting)"] is False  # 2.0x
    assert checks["ort-int8 time / ct2-int8 time (worst setting)"] is True  # 1.25x
    assert checks["export.runtime cold start, one sentence"] is True
    assert checks["export.runtime peak resident memory"] is False


def test_agreement_counts_rows_identical_to_keras():
    workers = _workers()
    measured = {(name, 2, "greedy"): {"tokens": [[5, 6], [7, 8]]} for name in workers}
    measured["ort-int8@1", 2, "greedy"] = {"tokens": [[5, 6], [7, 9, 9]]}
    result = {a["system"]: a for a in serve.agreement(measured, workers)}
    assert result["ort-float32"]["rows_identical_to_keras"] == 2
    assert result["ort-int8"]["rows_identical_to_keras"] == 1
    assert result["ort-int8"]["equal_lengths"] is False
    assert "keras" not in result


def test_installed_size_follows_dependencies():
    size = serve.installed_size(["pytest"])
    assert "pytest" in size["distributions"] and "pluggy" in size["distributions"]
    assert size["mb"] > serve.installed_size(["pluggy"])["mb"] > 0
