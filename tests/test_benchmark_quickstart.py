"""The Quick start benchmark's bookkeeping (`benchmarks/quickstart.py`), without training.

The benchmark trains for hours (see benchmarks/README.md); these check what
would silently bend its figures: the command each setting runs, which
files count as checkpoints, and which checkpoints a time point averages.
"""

import pytest

from keras_transformer import quickstart as settings_module
from keras_transformer.train import build_parser

bench = pytest.importorskip("benchmarks.quickstart")


@pytest.mark.parametrize("name", list(bench.SETTINGS))
def test_each_setting_is_the_quickstart_with_its_levers_as_the_train_command_reads_it(name):
    arguments = bench.setting(name, keep_checkpoints=1000)
    command = bench.train_command("runs/x", arguments)
    assert command[1:3] == ["-m", "keras_transformer.train"]
    parsed = vars(build_parser().parse_args(command[3:]))
    expected = {**settings_module.SETTINGS, **bench.SETTINGS[name], "keep_checkpoints": 1000}
    assert {key: parsed[key] for key in expected} == expected


def test_unknown_setting_is_one_line():
    with pytest.raises(SystemExit, match="unknown setting 'fast'; choose from quickstart"):
        bench.setting("fast")


def test_checkpoints_are_the_finished_files_only(tmp_path):
    folder = tmp_path / "run" / "training" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("ckpt-00000200.weights.h5", "ckpt-00000100.weights.h5",
                 ".ckpt-00000300.weights.h5.tmp-123.weights.h5", "resume.weights.h5"):
        (folder / name).write_bytes(b"")
    assert [update for update, _, _ in bench.checkpoints(tmp_path / "run")] == [100, 200]


def test_a_time_point_averages_the_last_checkpoints_written_by_then():
    timeline = [(100, 200.0), (200, 400.0), (300, 600.0), (400, 800.0)]
    assert bench.written_by(timeline, 650, last=3) == [(100, 200.0), (200, 400.0), (300, 600.0)]
    assert bench.written_by(timeline, 900, last=3) == [(200, 400.0), (300, 600.0), (400, 800.0)]
    assert bench.written_by(timeline, 100, last=3) == []
