"""The notebooks in colab/: well formed and stripped (fast), and run top to bottom (slow).

The slow test executes each notebook with nbclient in a fresh `python3` kernel
(the interpreter running pytest), with `KT_NOTEBOOK_SMOKE=1` (tiny preset, a few
steps, the bundled corpus, no network; notebook 03 reads the suite's trained tiny preset and its
exports, notebook 04 the suite's Marian stand-in) and a temporary working directory, so
everything the notebook writes lands there and not in the repository.
"""

import pathlib
import re
import time

import pytest


nbformat = pytest.importorskip("nbformat")

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"
EXPECTED = ["01_quickstart.ipynb", "02_wmt14_multi_gpu.ipynb", "03_export_and_serve.ipynb", "04_pretrained.ipynb"]
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/OWNER/REPO/blob/main/colab/NAME.ipynb)
BADGE = re.compile(
    r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
    r"\(https://colab\.research\.google\.com/github/(?P<repo>[\w.-]+/[\w.-]+)/blob/main/colab/(?P<name>[\w.-]+\.ipynb)\)"
)
CELL_TIMEOUT_S = 600
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython's tracebacks


def _read(path):
    return nbformat.read(str(path), as_version=4)


def test_colab_holds_the_four_notebooks():
    missing = sorted(set(EXPECTED) - {path.name for path in NOTEBOOKS})
    assert not missing, f"colab/ lacks {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_stripped_and_starts_with_the_badge(path):
    notebook = _read(path)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {index} has outputs; save the notebook without them"
            assert cell.execution_count is None, f"{path.name}: cell {index} has an execution count"
    first = notebook.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell must be markdown with the Colab badge"
    match = BADGE.search(first.source)
    assert match, f"{path.name}: no 'Open In Colab' badge in the first cell:\n{first.source[:300]}"
    assert match["name"] == path.name, f"{path.name}: the badge opens {match['name']}"
    install = notebook.cells[1]
    assert install.cell_type == "code" and "%pip install" in install.source
    # The install is skipped where the package is importable (the tests have no network).
    assert 'find_spec("keras_transformer") is None' in install.source
    # The switch the slow test (and CI) runs the notebook with.
    assert any("KT_NOTEBOOK_SMOKE" in cell.source for cell in notebook.cells if cell.cell_type == "code")


def test_badges_point_at_one_repository():
    repositories = {BADGE.search(_read(path).cells[0].source)["repo"] for path in NOTEBOOKS}
    assert len(repositories) == 1, f"the badges name several repositories: {sorted(repositories)}"


@pytest.mark.slow
@pytest.mark.own_processes  # the kernels run on the TensorFlow backend (export needs it), whatever the suite's
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_in_smoke_mode(path, tmp_path, monkeypatch, record_property, request):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    monkeypatch.setenv("KT_NOTEBOOK_SMOKE", "1")
    if path.name == "04_pretrained.ipynb":  # the suite's Marian stand-in (built once per machine), read only
        monkeypatch.setenv("KT_MARIAN_STANDIN", str(request.getfixturevalue("marian_trained")))
    if path.name == "03_export_and_serve.ipynb":  # the suite's tiny preset and its exports (built once), read only
        monkeypatch.setenv("KT_NOTEBOOK_EXPORTS", str(request.getfixturevalue("tiny_trained")))
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    repository_runs = (COLAB / "runs").exists()
    notebook = _read(path)
    # kernel "python3" starts the interpreter running pytest (jupyter_client
    # replaces the kernelspec's "python" with sys.executable).
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        startup_timeout=180,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    started = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:
        executed = tmp_path / f"executed-{path.name}"
        nbformat.write(notebook, str(executed))
        message = ANSI_ESCAPE.sub("", str(error))  # names the cell's source and the error
        pytest.fail(f"{path.name} failed (executed copy: {executed}):\n{message}", pytrace=False)
    seconds = time.perf_counter() - started
    record_property("smoke_seconds", round(seconds, 1))
    print(f"{path.name}: {seconds:.0f} s in smoke mode")

    # Outputs went to the temporary working directory, not into the repository.
    assert (tmp_path / "runs").is_dir(), f"{path.name} wrote no runs/ in its working directory"
    assert repository_runs or not (COLAB / "runs").exists(), f"{path.name} wrote into colab/runs"
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} drew no figure"

