"""Shared test helpers. The backend comes from KERAS_BACKEND (tensorflow, jax, torch)."""

import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def tiny_model(**overrides):
    """A small deterministic model for tests; dropout 0 unless overridden."""
    import keras_transformer as kt

    keras.utils.set_random_seed(overrides.pop("seed", 1234))
    config = dict(
        vocabulary_size=50, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=64,
    )
    config.update(overrides)
    return kt.TransformerModel(**config)


def random_ids(rng, batch, length, vocabulary_size=50, low=4):
    """Ids in [low, vocabulary_size), i.e. no special ids."""
    return rng.integers(low, vocabulary_size, size=(batch, length)).astype("int32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_report_header(config):
    return f"keras backend: {BACKEND}"


# ---------------------------------------------------------------------- #
# Tests whose behaviour does not depend on the Keras backend run once.
# ---------------------------------------------------------------------- #
# tests/run.sh runs the suite once per backend. What these tests check (text
# and file handling, the corpus, the tokenizer, tf.data batching, directory
# and resume bookkeeping, command-line plumbing, benchmark arithmetic) is the
# same code on every backend, so they run on TensorFlow only; the model, the
# layers, the search, the losses, the schedule, training steps and the
# optimizer state round trip run on all three. A name listed here that no
# longer matches a test only makes that test run on every backend again.
# KT_ALL_BACKENDS=1 runs everything on the current backend.
BACKEND_INDEPENDENT = {
    "test_datasets.py": ["*"],
    "test_tokenizer.py": ["*"],
    "test_data.py": ["*"],
    "test_benchmarks.py": ["*"],
    "test_benchmark_quickstart.py": ["*"],
    # benchmarks/device.sh starts its own JAX and PyTorch processes.
    "test_device_benchmark.py": ["*"],
    "test_progress.py": ["*"],
    "test_quickstart.py": ["*"],
    "test_utils.py": ["*"],
    "test_inputs.py": [
        "test_every_reader_*", "test_stdin_*", "test_line_end_*", "test_bundled_corpus_*", "test_textio_*",
        "test_reading_errors_*", "test_tokenizer_training_*", "test_sentencepiece_*", "test_bad_config_json_*",
        "test_weights_file_that_is_not_hdf5_*", "test_bad_tokenizer_model_*", "test_evaluate_cli_*",
        "test_translate_cli_*", "test_cli_user_errors_*",
    ],
    "test_translator.py": ["test_translate_cli_*", "test_evaluate_cli_*"],
    # The tokenizer, the handle and the refusals; the model's numbers run on every backend.
    "test_convert_marian.py": [
        "test_tokenizer_*", "test_language_codes_*", "test_hf_handle_*", "test_configs_*", "test_a_pickle_*",
        "test_separate_*", "test_tensors_*", "test_stored_position_*",
    ],
    # All but fine-tuning the Marian stand-in (the backend's training, checkpoint import and resume).
    "test_finetune.py": [
        "test_init_from_refuses_*", "test_init_from_a_preset_directory_*", "test_init_from_a_pretrained_*",
        "test_preset_directory_*", "test_train_cli_*", "test_translate_cli_*",
    ],
    # All but the two tests of the resumed optimizer state.
    "test_training_durability.py": [
        "test_train_cli_*", "test_average_checkpoints_cli_*", "test_run_training_refuses_*", "test_overwrite_*",
        "test_a_directory_that_is_not_ours_*", "test_a_truncated_state_*", "test_a_finished_run_*",
        "test_resume_with_other_arguments_*", "test_resume_refuses_*", "test_a_run_without_progress_*",
        "test_a_resumed_run_with_accumulation_*", "test_stale_temporaries_*", "test_atomic_directory_*",
        "test_an_interrupted_preset_installation_*",
    ],
}


def _backend_independent(item):
    import fnmatch

    patterns = BACKEND_INDEPENDENT.get(item.path.name, ())
    return any(fnmatch.fnmatchcase(item.originalname, pattern) for pattern in patterns)


def pytest_collection_modifyitems(config, items):
    if BACKEND == "tensorflow" or os.environ.get("KT_ALL_BACKENDS") == "1":
        return
    skip = pytest.mark.skip(reason="backend-independent: runs once, on the TensorFlow backend (KT_ALL_BACKENDS=1 to run)")
    for item in items:
        if _backend_independent(item):
            item.add_marker(skip)


# ---------------------------------------------------------------------- #
# Marian (OPUS-MT) stand-in checkpoints, built locally with transformers.
# ---------------------------------------------------------------------- #
# Built once per machine and reused by every backend's run (tests/run.sh runs
# pytest once per backend): the checkpoint only depends on the builder's code
# and the versions of transformers, torch and sentencepiece, which key the cache.
MARIAN_STANDINS = {
    "random": dict(train_steps=0),      # random init (random logits bias and <pad> row)
    "trained": dict(train_steps=400),   # trained on the bundled corpus: outputs end with </s>
}


def _marian_standin(request, kind):
    import hashlib
    import importlib.metadata
    import inspect
    import shutil
    import tempfile

    pytest.importorskip("transformers")
    from keras_transformer.convert import standin

    versions = [importlib.metadata.version(name) for name in ("transformers", "torch", "sentencepiece")]
    key = hashlib.sha256((inspect.getsource(standin) + repr(versions) + repr(MARIAN_STANDINS[kind])).encode()).hexdigest()[:16]
    root = pathlib.Path(request.config.cache.mkdir("marian-standins"))
    directory = root / f"{kind}-{key}"
    if not (directory / "model.safetensors").is_file():
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
        standin.build_marian_checkpoint(staging / "checkpoint", **MARIAN_STANDINS[kind])
        try:
            (staging / "checkpoint").rename(directory)
        except OSError:  # another process built it first
            pass
        shutil.rmtree(staging, ignore_errors=True)
    return directory


@pytest.fixture(scope="session")
def marian_random(request):
    """A random-init Marian checkpoint directory in the Hugging Face layout (read only)."""
    return _marian_standin(request, "random")


@pytest.fixture(scope="session")
def marian_trained(request):
    """A Marian checkpoint trained for a few hundred steps on the bundled corpus (read only)."""
    return _marian_standin(request, "trained")


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """The Hugging Face Hub unreachable, with an empty cache (returned): an hf:// handle resolves from it or not at all."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def populate_hub_cache(cache, repo_id, checkpoint, revision="0123456789abcdef0123456789abcdef01234567"):
    """Puts `checkpoint` in the Hugging Face cache layout as `repo_id`: models--org--name/snapshots/<rev>/, refs/main."""
    import shutil

    repository = pathlib.Path(cache) / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repository / "snapshots" / revision)
    (repository / "refs").mkdir(parents=True, exist_ok=True)
    (repository / "refs" / "main").write_text(revision)
    return repository / "snapshots" / revision
