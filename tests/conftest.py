"""Shared test helpers. The backend comes from KERAS_BACKEND (tensorflow, jax, torch)."""

import os
import pathlib
import sys

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
        dropout=0.0, max_sequence_length=TINY_EXPORT_MAX_SEQUENCE_LENGTH,
    )
    config.update(overrides)
    return kt.TransformerModel(**config)


def resume_after_the_first_interval(tmp_path, build):
    """`build(1234)` trained 3 intervals of 2 steps with a resume point, and `build(7)` resumed after interval 1.

    `build(seed)` returns a compiled model; seed 7 gives other weights and
    dropout seeds, as another process may get. Returns `(uninterrupted,
    resumed, first)`, `first` being the resume point written after interval 1.
    """
    import shutil

    import tensorflow as tf

    from keras_transformer import training

    x = {"encoder_token_ids": np.full((2, 5), 7, "int32"), "decoder_token_ids": np.full((2, 4), 8, "int32")}
    dataset = tf.data.Dataset.from_tensors((x, np.full((2, 4), 9, "int32"))).repeat()
    path, first = tmp_path / training.RESUME_FILE, tmp_path / "after-interval-1.weights.h5"

    class KeepTheFirst(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                shutil.copyfile(path, first)

    model = build(1234)
    model.fit(dataset, epochs=3, steps_per_epoch=2, callbacks=[training.ResumePoint(path), KeepTheFirst()], verbose=0)
    resumed = build(7)
    state = training.load_resume_point(resumed, first)
    resumed.fit(dataset, epochs=3, initial_epoch=1, steps_per_epoch=2, verbose=0,
                callbacks=[training.ResumePoint(tmp_path / "resumed.weights.h5", random_state=state)])
    return model, resumed, first


def random_ids(rng, batch, length, vocabulary_size=50, low=4):
    """Ids in [low, vocabulary_size), i.e. no special ids."""
    return rng.integers(low, vocabulary_size, size=(batch, length)).astype("int32")


@pytest.fixture(autouse=True)
def _user_cache_untouched(monkeypatch, tmp_path_factory):
    """`python -m export.runtime` keeps optimised graphs in the user's cache: in the tests, a directory of their own."""
    monkeypatch.setenv("KERAS_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "keras_transformer_cache"))


# PyTorch's thread count when a test first saw PyTorch imported.
_TORCH_THREADS = []


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test leaves PyTorch's thread count as the suite found it.

    CTranslate2 (a `Translator`, even in a module fixture's setup) sets the
    process's OpenMP thread count, which PyTorch reads as its own: the
    CTranslate2 tests once left the PyTorch run's later training on one
    thread, with other numbers.
    """
    torch = sys.modules.get("torch")
    if torch is not None and not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _TORCH_THREADS and torch.get_num_threads() != _TORCH_THREADS[0]:
        torch.set_num_threads(_TORCH_THREADS[0])


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
# same code on every backend, so they run once, beside the own_processes tests
# below (in the run of KT_PROCESS_TESTS_BACKEND: PyTorch's, in the second lane,
# under tests/run.sh, which runs their small models eagerly where TensorFlow
# and JAX compile each new model's search first, and leaves the TensorFlow
# lane to the exports; TensorFlow's when pytest runs alone); the model, the
# layers, the search, the losses, the schedule, training steps and the
# optimizer state round trip run on all three. A name listed here that no
# longer matches a test only makes that test run on every backend again.
#
# Tests marked `own_processes` (the notebooks, the device smoke run, the
# training killed with SIGKILL, one weights file loaded on every backend) run
# their work in processes of their own, whatever the suite's backend, so they
# too run once: in the run of the backend that KT_PROCESS_TESTS_BACKEND names
# (TensorFlow unless set). tests/run.sh gives them to the PyTorch run, the shortest, which shares
# a lane with JAX beside the TensorFlow lane, so that the two lanes end at
# about the same time.
# KT_ALL_BACKENDS=1 runs everything on the current backend.
PROCESS_TESTS_BACKEND = os.environ.get("KT_PROCESS_TESTS_BACKEND", "tensorflow")
# These own_processes tests run in the first lane's run instead (KT_FIRST_LANE_BACKEND, which tests/run.sh
# sets to its first backend, TensorFlow): with all of them, the second lane (JAX then PyTorch) ended about
# 5 min after the first (2026-12-06, 22:04: 2532 s against 2195 s); notebook 04 (143 s) evens them.
FIRST_LANE_BACKEND = os.environ.get("KT_FIRST_LANE_BACKEND", PROCESS_TESTS_BACKEND)
FIRST_LANE_PROCESS_TESTS = {
    "test_notebooks.py": ["test_notebook_runs_top_to_bottom_in_smoke_mode[[]04_pretrained[]]"],
}
BACKEND_INDEPENDENT = {
    "test_datasets.py": ["*"],
    "test_docs.py": ["*"],
    "test_documents.py": ["test_split_*", "test_cut_*", "test_sentence_*", "test_lines_*"],
    "test_tokenizer.py": ["*"],
    "test_data.py": ["*"],
    "test_benchmarks.py": ["*"],
    "test_benchmark_finetune.py": ["*"],
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
    # The command lines, and the sentence splitting's Python around `translate` (cutting documents into
    # sentences and long sentences at clauses, joining the translations back; the searches it calls are
    # tested on each backend): 16 s of the JAX run, 24 s of TensorFlow's.
    "test_translator.py": ["test_translate_cli_*", "test_evaluate_cli_*", "test_split_sentences_*"],
    # All of it: options= and the keywords meet in the same Python on every backend (the searches themselves are
    # tested on each backend in test_generation.py and test_hypotheses.py); on TensorFlow, where each option's
    # search is traced anew, the Keras comparison alone took 124 s of the lane (20 s on JAX, 7 s on PyTorch).
    "test_search_options.py": ["*"],
    # All but the bundled test split, which a Keras model translates.
    "test_translate_file.py": [
        "test_length_batches_*", "test_translate_batches_*", "test_translate_iterable_*", "test_translate_file_*",
        "test_a_bad_line_*", "test_a_killed_run_*", "test_translate_cli_*", "test_memory_*",
    ],
    "test_scoring.py": ["test_translator_score_refuses_*"],
    # The refusals of return_alignment (Python checks): on JAX its fixtures waited 13.5 s for the tiny ONNX export
    # that the TensorFlow lane builds at the same time.
    "test_alignment.py": ["test_bad_return_alignment_*"],
    # The tokenizer, the handle and the refusals; the model's numbers run on every backend.
    "test_convert_marian.py": [
        "test_tokenizer_*", "test_language_codes_*", "test_hf_handle_*", "test_configs_*", "test_a_pickle_*",
        "test_separate_*", "test_tensors_*", "test_stored_position_*",
    ],
    "test_convert_marian_separate.py": ["test_tokenizer_*", "test_inconsistent_*"],
    "test_convert_m2m100.py": [
        "test_tokenizer_*", "test_legacy_*", "test_configs_*", "test_missing_*", "test_languages_are_*",
        "test_exporters_*", "test_train_cli_*", "test_translate_cli_*",
    ],
    "test_convert_fsmt.py": [
        "test_tokenizer_*", "test_configs_*", "test_an_untied_*", "test_missing_*", "test_exporters_*",
    ],
    # All but fine-tuning the Marian stand-in (the backend's training, checkpoint import and resume).
    "test_finetune.py": [
        "test_init_from_refuses_*", "test_init_from_a_preset_directory_*", "test_init_from_a_pretrained_*",
        "test_preset_directory_*", "test_train_cli_*", "test_translate_cli_*",
    ],
    # Configurations, shapes and parameter counts (base- and big-size models: slow to build on any backend);
    # the layers' numbers with key_dim != value_dim and one head run on every backend (tests/layers).
    "test_model.py": ["test_parameter_counts_*", "test_table_3_*"],
    # The export from every backend's weights, validated against that backend's search, runs on every backend
    # (the `exported` fixture); CTranslate2's side of the comparisons, the variants' weight mapping, int8 and
    # the refusals are the same on every backend. So is `return_attention` against our alignment: the weights
    # are hand-set from NumPy, and the alignment is `alignment_attention` teacher forced after the search (its
    # numbers on every backend: tests/test_alignment.py); JAX compiled a search per source length for it, 80 s.
    "test_export_ctranslate2.py": [
        "test_text_in_text_out_*", "test_beam_search_with_length_penalty_zero", "test_int8_*",
        "test_return_attention_argmax_is_our_alignment",
        "test_half_split_sinusoids_*", "test_variants_*", "test_empty_outputs_*", "test_unsupported_*",
        "test_old_format_*", "test_cli_*", "test_bad_quantization_*",
    ],
    # The refusals, the command's plumbing, the model card and the skipped validation; the export of each
    # backend's weights, validated against transformers, runs on every backend.
    "test_export_huggingface.py": [
        "test_what_marian_*", "test_cli_*", "test_overwrite_*", "test_validation_is_skipped_*", "test_model_card_*",
    ],
    # The argument checks and the command's plumbing; the training, merging and resume run on every backend.
    "test_lora.py": ["test_run_training_refuses_bad_lora_*", "test_train_cli_*"],
    # All but the two tests of the resumed optimizer state.
    "test_training_durability.py": [
        "test_train_cli_*", "test_average_checkpoints_cli_*", "test_run_training_refuses_*", "test_overwrite_*",
        "test_a_directory_that_is_not_ours_*", "test_a_truncated_state_*", "test_a_finished_run_*",
        "test_resume_with_other_arguments_*", "test_resume_refuses_*", "test_a_run_without_progress_*",
        "test_the_validation_options_are_*",
        "test_a_resumed_run_with_accumulation_*", "test_stale_temporaries_*", "test_atomic_directory_*",
        "test_an_interrupted_preset_installation_*",
    ],
}


def _backend_independent(item):
    import fnmatch

    patterns = BACKEND_INDEPENDENT.get(item.path.name, ())
    return any(fnmatch.fnmatchcase(item.originalname, pattern) for pattern in patterns)


def _process_tests_backend(item):
    """The backend whose run runs the own_processes test `item`: FIRST_LANE_BACKEND for those listed, else
    PROCESS_TESTS_BACKEND."""
    import fnmatch

    patterns = FIRST_LANE_PROCESS_TESTS.get(item.path.name, ())
    if any(fnmatch.fnmatchcase(item.name, pattern) for pattern in patterns):
        return FIRST_LANE_BACKEND
    return PROCESS_TESTS_BACKEND


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KT_ALL_BACKENDS") == "1":
        return
    for item in items:
        if item.get_closest_marker("own_processes"):
            backend = _process_tests_backend(item)
            if BACKEND != backend:
                variable = "KT_FIRST_LANE_BACKEND" if backend != PROCESS_TESTS_BACKEND else "KT_PROCESS_TESTS_BACKEND"
                item.add_marker(pytest.mark.skip(
                    reason=f"runs its own processes once, in the {backend} run ({variable})"
                ))
        elif _backend_independent(item):
            if BACKEND != PROCESS_TESTS_BACKEND:
                item.add_marker(pytest.mark.skip(
                    reason=f"backend-independent: runs once, in the {PROCESS_TESTS_BACKEND} run "
                    "(KT_PROCESS_TESTS_BACKEND; KT_ALL_BACKENDS=1 to run)"
                ))


# ---------------------------------------------------------------------- #
# Marian (OPUS-MT) stand-in checkpoints, built locally with transformers.
# ---------------------------------------------------------------------- #
# Built once per machine (`build_once`): the checkpoint only depends on the
# builder's code and the versions of transformers, torch and sentencepiece.
MARIAN_STANDINS = {
    "random": dict(train_steps=0),      # random init (random logits bias and <pad> row)
    "trained": dict(train_steps=400),   # trained on the bundled corpus: outputs end with </s>
    # Separate source and target vocabularies (transformers PR #15831): the source's larger, so the two <pad>s differ.
    "separate-random": dict(train_steps=0, separate_vocabs=True, source_vocabulary_size=400,
                            target_vocabulary_size=300),
    "separate-trained": dict(train_steps=400, separate_vocabs=True, source_vocabulary_size=400,
                             target_vocabulary_size=300),
}


def build_once(request, name, key, build):
    """`build(directory)` once per machine: `name-key/model` in pytest's cache, unless finished there already.

    Slow artifacts (an ONNX export, a Marian stand-in) are built once and
    shared by every backend's run (tests/run.sh runs pytest once per backend, two at a time)
    and by later runs on the same code; `key` must change with whatever
    changes the artifact. The artifact is alone in its parent directory (so a
    test can check that its writer left no temporaries beside it), and a
    marker beside that parent says it is finished (a killed build is redone).
    Without the cache plugin (-p no:cacheprovider) it is built in a temporary
    directory. Tests read it only: copy it to change it.
    """
    import fcntl
    import shutil

    if getattr(request.config, "cache", None) is None:
        directory = request.getfixturevalue("tmp_path_factory").mktemp(name) / "model"
        build(directory)
        return directory
    root = pathlib.Path(request.config.cache.mkdir("artifacts"))
    parent, done = root / f"{name}-{key}", root / f"{name}-{key}.done"
    # tests/run.sh runs two backends at once: one builds, the other waits for it.
    with open(root / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(parent, ignore_errors=True)
            parent.mkdir()
            build(parent / "model")
            done.write_text("")
    return parent / "model"


def source_key(*paths, packages=()):
    """A digest of the repository files under `paths` (globs) and the versions of `packages`."""
    import hashlib
    import importlib.metadata

    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for pattern in paths:
        for path in sorted(root.glob(pattern)):
            digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    for name in packages:
        digest.update(f"{name}=={importlib.metadata.version(name)}".encode())
    return digest.hexdigest()[:16]


# Sentences of the bundled corpus's domain that the imported-checkpoint tests translate and compare.
SENTENCES = [
    "Open the Styles deck.",
    "Select the cells that you want to delete.",
    "Click OK.",
    "The document contains hidden paragraphs; choose View - Formatting Marks to show them.",
]


def copy_with_config(source, destination, **changes):
    """A copy of the checkpoint directory `source` at `destination`, its config.json updated with `changes`."""
    import json
    import shutil

    shutil.copytree(source, destination)
    path = destination / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return destination


def padded(rows, pad):
    """Ragged id rows as one int64 `[B, T]` batch filled with `pad`."""
    batch = np.full((len(rows), max(map(len, rows))), pad, dtype="int64")
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    return batch


def hf_marian_model(directory):
    """`transformers.MarianMTModel` of a checkpoint directory, in eval mode (the reference)."""
    import transformers

    return transformers.MarianMTModel.from_pretrained(str(directory)).eval()


def hf_marian_tokenizer(directory):
    """`transformers.MarianTokenizer` of a checkpoint directory (the reference)."""
    import transformers

    return transformers.MarianTokenizer.from_pretrained(str(directory))


def _marian_standin(request, kind):
    pytest.importorskip("transformers")
    from keras_transformer.convert import standin

    key = source_key("keras_transformer/convert/standin.py", packages=("transformers", "torch", "sentencepiece"))
    config = MARIAN_STANDINS[kind]
    return build_once(request, f"marian-{kind}", f"{key}-{config['train_steps']}",
                      lambda directory: standin.build_marian_checkpoint(directory, **config))


@pytest.fixture(scope="session")
def marian_random(request):
    """A random-init Marian checkpoint directory in the Hugging Face layout (read only)."""
    return _marian_standin(request, "random")


@pytest.fixture(scope="session")
def marian_trained(request):
    """A Marian checkpoint trained for a few hundred steps on the bundled corpus (read only)."""
    return _marian_standin(request, "trained")


@pytest.fixture(scope="session")
def marian_separate_random(request):
    """A random-init Marian checkpoint with separate source and target vocabularies (read only)."""
    return _marian_standin(request, "separate-random")


@pytest.fixture(scope="session")
def marian_separate_trained(request):
    """`marian_separate_random`'s layout, trained for a few hundred steps (read only)."""
    return _marian_standin(request, "separate-trained")


# NLLB-200-style (M2M-100 architecture) stand-ins, built the same way.
NLLB_STANDINS = {
    "random": dict(train_steps=0),      # random init, random LayerNorms
    "trained": dict(train_steps=300),   # eng_Latn -> deu_Latn on the bundled corpus: outputs end with </s>
}


def _nllb_standin(request, kind):
    pytest.importorskip("transformers")
    from keras_transformer.convert import standin

    key = source_key("keras_transformer/convert/standin.py", packages=("transformers", "torch", "sentencepiece"))
    config = NLLB_STANDINS[kind]
    return build_once(request, f"nllb-{kind}", f"{key}-{config['train_steps']}",
                      lambda directory: standin.build_nllb_checkpoint(directory, **config))


@pytest.fixture(scope="session")
def nllb_random(request):
    """A random-init NLLB checkpoint directory in the Hugging Face layout (read only)."""
    return _nllb_standin(request, "random")


@pytest.fixture(scope="session")
def nllb_trained(request):
    """An NLLB checkpoint trained for a few hundred steps (eng_Latn -> deu_Latn; read only)."""
    return _nllb_standin(request, "trained")


# An FSMT (fairseq WMT19) stand-in: Moses + BPE learned on the bundled corpus, two vocabularies, random weights.
@pytest.fixture(scope="session")
def fsmt_random(request):
    """A random-init FSMT checkpoint directory in the Hugging Face layout of facebook/wmt19-en-de (read only)."""
    pytest.importorskip("transformers")
    pytest.importorskip("sacremoses")
    from keras_transformer.convert import standin

    key = source_key("keras_transformer/convert/standin.py", "keras_transformer/tokenizers/fsmt.py",
                     packages=("transformers", "torch", "sacremoses"))
    return build_once(request, "fsmt-random", key, standin.build_fsmt_checkpoint)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """The Hugging Face Hub unreachable, with an empty cache (returned): an hf:// handle resolves from it or not at all."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def refuse_graph_conversion(monkeypatch):
    """Makes `export.onnx` fail if it converts a graph: for refusals that must come before any conversion."""
    from export import onnx as onnx_export

    def not_reached(*args, **kwargs):
        raise AssertionError("a graph was converted before the refusal")

    for name in ("build_fused_step", "graph_functions"):
        monkeypatch.setattr(onnx_export, name, not_reached)


def populate_hub_cache(cache, repo_id, checkpoint, revision="0123456789abcdef0123456789abcdef01234567"):
    """Puts `checkpoint` in the Hugging Face cache layout as `repo_id`: models--org--name/snapshots/<rev>/, refs/main."""
    import shutil

    repository = pathlib.Path(cache) / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(checkpoint, repository / "snapshots" / revision)
    (repository / "refs").mkdir(parents=True, exist_ok=True)
    (repository / "refs" / "main").write_text(revision)
    return repository / "snapshots" / revision


# ---------------------------------------------------------------------- #
# One tiny exported model, shared by the ONNX export and server tests.
# ---------------------------------------------------------------------- #
TINY_CORPUS = [
    f"{s} {v} {o}"
    for s in ("the cat", "a dog", "my bird", "the old fish")
    for v in ("sees", "likes", "eats")
    for o in ("the cat.", "a dog.", "the big fish.", "a red ball.")
]
TINY_VOCABULARY_SIZE = 60
# The tiny export's max_sequence_length: longer sources are cut (tests/test_export_text_graph.py).
TINY_EXPORT_MAX_SEQUENCE_LENGTH = 64


def tiny_export_model(seed=1234):
    """The model of `tiny_preset_dir` (same seed, same weights), or another one (another seed)."""
    import keras_transformer as kt

    keras.utils.set_random_seed(seed)
    return kt.TransformerModel(
        vocabulary_size=TINY_VOCABULARY_SIZE, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=TINY_EXPORT_MAX_SEQUENCE_LENGTH,
    )


@pytest.fixture(scope="session")
def tiny_preset_dir(tmp_path_factory):
    """A preset directory: `tiny_export_model()` with a tokenizer trained on `TINY_CORPUS` (read only)."""
    import keras_transformer as kt

    directory = tmp_path_factory.mktemp("tiny-preset") / "tiny"
    tiny_export_model().save_to_preset(directory, tokenizer=kt.train_tokenizer(TINY_CORPUS, TINY_VOCABULARY_SIZE))
    return directory


@pytest.fixture(scope="session")
def tiny_onnx_export(request, tiny_preset_dir):
    """`tiny_preset_dir` exported by `export.onnx` (validated), built once per machine and code (read only)."""
    pytest.importorskip("tf2onnx")
    from export.onnx import export_onnx

    key = source_key("export/*.py", "keras_transformer/**/*.py", "tests/conftest.py",
                     packages=("tensorflow", "keras", "tf2onnx", "onnx", "onnxruntime", "sentencepiece"))

    def build(directory):
        if BACKEND == "tensorflow":
            export_onnx(tiny_preset_dir, directory)
            return
        # The export traces TensorFlow graphs: another backend's run that gets here first (the backend-independent
        # tests run in the PyTorch run) exports in a TensorFlow process of its own.
        import subprocess

        command = [sys.executable, "-m", "export.onnx", "--preset", str(tiny_preset_dir), "--output", str(directory)]
        environment = {**os.environ, "KERAS_BACKEND": "tensorflow"}
        subprocess.run(command, cwd=pathlib.Path(__file__).parent.parent, env=environment, check=True, timeout=900)

    return build_once(request, "tiny-onnx", key, build)


# ---------------------------------------------------------------------- #
# The tiny preset trained on the bundled corpus, exported as a user does.
# ---------------------------------------------------------------------- #
# Built once per machine (`build_once`) by the commands, whichever backend's
# run asks first: the same files on every lane. Read by the commands' test (the
# train and export commands' stderr, and what the other commands read), the
# int8 quality test (the preset and its int8 export) and notebook 03 in smoke
# mode (KT_NOTEBOOK_EXPORTS), which would otherwise each train and export one.
ROOT = pathlib.Path(__file__).resolve().parent.parent
# The validation lines give the checkpoint lines' val_loss (tests/test_cli.py) and the validation BLEU at the end,
# whose beam search compiles once per length bucket: few lines, few buckets.
TINY_TRAINED_STEPS, TINY_TRAINED_CHECKPOINT_EVERY, TINY_TRAINED_VALID_LINES = 400, 200, 8
# The artifact's parts: the preset, its float32 and int8 ONNX exports, the
# validation files (the first lines of the bundled split), and each command's
# stderr as `train.stderr`, `onnx.stderr` and `int8.stderr`.
TINY_TRAINED_PARTS = {"preset": "preset", "onnx": "onnx", "int8": "onnx-int8", "valid": ("valid.en", "valid.de")}


def run_command(*args, input=None, timeout=600):
    """`python -m ARGS` as a user runs it: from the repository root, TensorFlow backend, no TF_CPP_MIN_LOG_LEVEL."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["KERAS_BACKEND"] = "tensorflow"
    return subprocess.run(
        [sys.executable, "-m", *args], input=input, capture_output=True, text=True, timeout=timeout, env=env,
        cwd=ROOT,
    )


def _build_tiny_trained(directory):
    from keras_transformer import datasets

    directory.mkdir()
    preset, onnx, int8 = (str(directory / TINY_TRAINED_PARTS[part]) for part in ("preset", "onnx", "int8"))
    valid = [directory / name for name in TINY_TRAINED_PARTS["valid"]]
    for path, lines in zip(valid, datasets.load_bundled("valid")):
        path.write_text("\n".join(lines[:TINY_TRAINED_VALID_LINES]) + "\n", encoding="utf-8")
    commands = {  # the training data: the bundled corpus (no --train-src)
        "train": ["keras_transformer.train", "--preset", "tiny", "--output", preset,
                  "--steps", str(TINY_TRAINED_STEPS), "--checkpoint-every", str(TINY_TRAINED_CHECKPOINT_EVERY),
                  "--tokens-per-batch", "2048", "--warmup-steps", "200", "--learning-rate-scale", "2.0",
                  "--vocabulary-size", "1000", "--tokenizer-max-sentences", "3000", "--average-last", "1",
                  "--valid-src", str(valid[0]), "--valid-tgt", str(valid[1])],
        "onnx": ["export.onnx", "--preset", preset, "--output", onnx],
        # The float32 export's graphs, quantized (its tf2onnx conversion is not repeated).
        "int8": ["export.onnx", "--preset", preset, "--output", int8, "--quantize", "int8", "--from-float32", onnx],
    }
    for name, args in commands.items():
        # The float32 export took more than 600 s (run_command's default) beside the other lane on a loaded
        # 2-core machine, which failed every test that reads this artifact; a build, not a test, so no limit
        # is proved by a tighter one.
        result = run_command(*args, timeout=1800)
        (directory / f"{name}.stderr").write_text(result.stderr, encoding="utf-8")
        if result.returncode != 0:
            raise RuntimeError(f"python -m {' '.join(args)} failed:\n{result.stderr[-3000:]}")


@pytest.fixture(scope="session")
def tiny_trained(request):
    """The `tiny` preset trained on the bundled corpus and exported to ONNX, float32 and int8 (read only).

    A directory with `TINY_TRAINED_PARTS`; see `_build_tiny_trained` for the commands.
    """
    pytest.importorskip("tf2onnx")
    pytest.importorskip("onnxruntime")
    key = source_key("export/*.py", "keras_transformer/**/*.py", "keras_transformer/datasets/*/manifest.json",
                     "tests/conftest.py",
                     packages=("tensorflow", "keras", "tf2onnx", "onnx", "onnxruntime", "sentencepiece"))
    return build_once(request, "tiny-trained", key, _build_tiny_trained)
