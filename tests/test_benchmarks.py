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
    natural_rows = [
        {"system": system, "batch": batch, "sentences_per_second": rate}
        for system, rates in {"ort-float32": (10.0, 45.0), "keras": (5.0, 12.0), "ct2-float32": (9.0, 40.0)}.items()
        for batch, rate in zip((1, 64), rates)
    ]
    natural = {"rows": natural_rows, "scaling": {"ort-float32": {"batches": [1, 64], "ratio": 4.5},
                                                  "keras": {"batches": [1, 64], "ratio": 2.4}}}
    goals = {c["goal"]: c for c in serve.goals(rows, cold, natural)}
    checks = {name: goal["met"] for name, goal in goals.items()}
    assert checks["ort-float32 vs Keras/XLA (worst setting)"] is False  # 1.6x < 2x
    assert goals["ort-float32 vs Keras/XLA (worst setting)"]["value"] == pytest.approx(1.6)
    assert checks["ort-int8 vs Keras/XLA (worst setting)"] is True  # 3.2x
    assert checks["ort-float32 time / ct2-float32 time (worst setting)"] is False  # 2.0x
    assert checks["ort-int8 time / ct2-int8 time (worst setting)"] is False  # 1.25x > 1.2x
    assert checks["export.runtime cold start, one sentence"] is True  # 0.5 s
    assert checks["export.runtime peak resident memory"] is False  # 250 MB
    ort_natural = goals["ort-float32 sentences/s over ct2-float32's, natural lengths (worst batch)"]
    assert ort_natural["met"] is True and ort_natural["value"] == pytest.approx(10 / 9)
    keras_natural = goals["keras sentences/s over ct2-float32's, natural lengths (worst batch)"]
    assert keras_natural["met"] is False and keras_natural["where"] == "natural B=64"  # 12 / 40
    assert checks["ort-float32 batch 64 over batch 1 sentences/s, natural"] is True
    assert checks["keras batch 64 over batch 1 sentences/s, natural"] is False
    assert not any("natural" in name for name in (c["goal"] for c in serve.goals(rows, cold)))


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


TOY_SIZES = {"layers": 1, "hidden": 4, "intermediate": 8, "heads": 2, "key": 2, "value": 3, "vocabulary": 10}


def test_step_flops_count_the_products_of_the_decoder_step():
    # Projections: self q, k (4x4), v (4x6), out (6x4); cross q (4x4), out (6x4);
    # feed-forward 4x8, 8x4; output layer 4x10. 2 FLOPs per multiply-add.
    weights = 2 * (16 + 16 + 24 + 24 + 16 + 24 + 32 + 32 + 40)
    assert serve.step_flops(TOY_SIZES, 0, 0) == weights
    # Attention products per attended position: q.k (2 heads x 2) and weights.v (2 heads x 3).
    assert serve.step_flops(TOY_SIZES, 3, 5) == weights + 2 * (2 * 2 + 2 * 3) * 8
    assert serve.model_sizes({"num_heads": 4, "hidden_dim": 16, "num_layers": 2, "num_decoder_layers": 3,
                              "intermediate_dim": 32, "vocabulary_size": 50, "key_dim": None, "value_dim": 8}) == {
        "layers": 3, "hidden": 16, "intermediate": 32, "heads": 4, "key": 4, "value": 8, "vocabulary": 50}


def test_decoded_flops_sum_every_step_of_every_hypothesis():
    rows = [(6, 3), (9, 0)]  # (source ids, tokens): 4 steps, then 1 step (the end id at once)
    expected = sum(serve.step_flops(TOY_SIZES, t, 6) for t in range(1, 5)) + serve.step_flops(TOY_SIZES, 1, 9)
    assert serve.decoded_flops(TOY_SIZES, rows, beam_size=4) == 4 * expected


def test_roofline_from_a_measured_gemm_rate():
    rates = serve.gemm_rates(TOY_SIZES, [1, 8], min_seconds=0.01)
    assert set(rates) == {1, 8} and all(rate > 0 for rate in rates.values())
    row = {"batch": 2, "beam_size": 4, "seconds": 0.5}
    decoded = [(6, 3), (9, 0)]
    serve.add_roofline(row, decoded, TOY_SIZES, rates)
    assert row["roofline_seconds"] == pytest.approx(serve.decoded_flops(TOY_SIZES, decoded, 4) / rates[8])
    assert row["x_roofline"] == pytest.approx(0.5 / row["roofline_seconds"])
    assert "x_roofline" not in serve.add_roofline({"batch": 3, "beam_size": 1, "seconds": 1.0}, decoded,
                                                  TOY_SIZES, rates)  # no rate measured for 3 rows


def test_gemm_rates_are_measured_in_a_one_thread_process():
    rates = serve.measure_gemm_rates(TOY_SIZES, [2, 2, 4], min_seconds=0.01)
    assert set(rates) == {2, 4} and all(rate > 0 for rate in rates.values())


class _FakeSystem:
    """Answers a source row of n ids with min(n, max_extra_length) tokens (one fewer with a patience)."""

    patience = None

    def __init__(self):
        self.max_extra_length, self.batches = 30, []

    def generate(self, sources, beam_size):
        self.batches.append(len(sources))
        return [[7] * (min(len(row), self.max_extra_length) - (self.patience is not None)) for row in sources]


class _FakeWorker:
    def __init__(self, system_name, shorter=False):
        self.system_name, self.threads, self.system, self.shorter = system_name, 1, _FakeSystem(), shorter

    def request(self, op, batches, beam_size, max_extra_length, patience=None):
        assert op == "pass"
        answer = serve._translate_pass(self.system, batches, beam_size, max_extra_length, patience)
        if self.shorter:
            answer["tokens"] = [tokens[:-1] for tokens in answer["tokens"]]
        answer["seconds"] = len(batches) * 0.1  # 0.1 s per batch, whatever its size
        return answer


def test_natural_table_translates_every_sentence_in_batches_and_reports_scaling():
    sources = [[5] * n for n in (3, 9, 4, 2, 6)]
    workers = {"keras@1": _FakeWorker("keras"), "ort-float32@1": _FakeWorker("ort-float32", shorter=True)}
    measured = serve.measure_natural(workers, sources, [1, 4], beam_size=4, rounds=2, max_extra_length=5)
    # A warm-up pass, then 2 rounds, each over both batch sizes: 5 batches of 1, 2 (4 + 1) of 4; Keras twice
    # (its exact search, and with patience 1).
    assert workers["keras@1"].system.batches == ([1] * 10 + [4, 1] * 2) * 3
    assert workers["keras@1"].system.max_extra_length == 30  # restored after each pass
    assert workers["keras@1"].system.patience is None
    rows, scaling = serve.summarize_natural(measured, workers, beam_size=4)
    keras = {r["batch"]: r for r in rows if r["system"] == "keras"}
    assert keras[1]["token_counts"] == [3, 5, 4, 2, 5]  # capped at max_extra_length=5
    assert keras[1]["sentences_per_second"] == pytest.approx(5 / 0.5)
    assert keras[4]["sentences_per_second"] == pytest.approx(5 / 0.2)
    assert scaling["keras"] == {"batches": [1, 4], "ratio": pytest.approx(2.5)}
    ort = next(r for r in rows if r["system"] == "ort-float32" and r["batch"] == 4)
    assert ort["rows_identical_to_keras"] == 0 and keras[4]["rows_identical_to_keras"] == 5
    patient = next(r for r in rows if r["system"] == "keras patience=1" and r["batch"] == 4)
    assert patient["patience"] == 1 and patient["token_counts"] == [2, 4, 3, 1, 4]
    # Compared with Keras' search of the same patience, and with its own exact search.
    assert patient["rows_identical_to_keras"] == 5 and patient["rows_identical_to_exact_search"] == 0
    assert [r["system"] for r in rows if r["batch"] == 4] == [
        "ort-float32", "keras", "ort-float32 patience=1", "keras patience=1"]
    results = {"throughput": [], "cold_start": [], "natural": {
        "weights": "random", "rows": rows, "scaling": scaling,
        "settings": {"sentences": 5, "beam_size": 4, "batch_sizes": [1, 4]}}}
    table = serve.markdown(results)
    assert "| 4 | keras | 25.00 | 3.8 |" in table and "| 2.50x |" in table
    # The ceiling: batch 1's time (0.5 s) over batch 4's products at the GEMM rate (set here: 0.1 s).
    keras[4]["roofline_seconds"] = 0.1
    serve.add_scaling_ceilings(results["natural"])
    assert scaling["keras"]["ceiling"] == pytest.approx(5.0) and "ceiling" not in scaling["ort-float32"]
    assert "| 2.50x (roofline: 5.00x) |" in serve.markdown(results)
    goal = next(g for g in serve.goals([], [], results["natural"]) if g["goal"].startswith("keras batch 4"))
    assert goal["met"] is False and "at most 5.00x at the roofline" in goal["where"]
    # Own steps 4 + 6 + 5 + 3 + 6 = 24; in batches of 4: 4 x (5 + 1), then 1 x 6.
    assert keras[4]["lockstep_over_own_steps"] == pytest.approx(30 / 24)
    assert keras[1]["lockstep_over_own_steps"] == 1.0


def test_weights_label_says_random_or_how_the_model_was_trained(tmp_path):
    assert serve._weights_label("small", tmp_path) == "random"
    (tmp_path / "metadata.json").write_text('{"weights": "random, seed 0"}')
    assert serve._weights_label(str(tmp_path), tmp_path) == "random"
    (tmp_path / "metadata.json").write_text('{"steps": 300, "valid_bleu": 1.02}')
    assert serve._weights_label(str(tmp_path), tmp_path) == "trained (300 updates, validation BLEU 1.02)"
