"""Opening an ONNX export with ONNX Runtime: its `config.json`, the execution providers, the sessions.

`read_config` checks an exported directory (and names what another kind of
directory is); `resolve_providers` picks CUDA when it works, else the CPU;
`new_session` and `_session_options` make the sessions every graph runs in;
`default_optimized_cache` and its command-line options say where optimised
graphs are kept, and `OptimizedGraphCache` (a base of `OnnxSeq2Seq`) reads
and writes them. `export/runtime.py` runs the graphs and keeps these names
importable. Framework-free, as `export.runtime`: onnxruntime, NumPy and the
standard library.
"""

import json
import logging
import os
import pathlib

from export import contract
from export.contract import CONFIG_FILE

# Named as `export.runtime`'s, whose sessions these are.
logger = logging.getLogger("export.runtime")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# The decoding cache: init_cache's outputs, decoder_step's inputs by the same names.
CACHE_KEYS = tuple(contract.INIT_CACHE.output_names())


def read_config(directory):
    """The `config.json` of an exported directory, after checking that every file is there.

    Raises:
        FileNotFoundError: the directory, its config or a graph is missing.
        ValueError: the directory is another kind of export, or from another
            format version.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"No ONNX model directory at {str(directory)!r}")
    if (directory / "saved_model.pb").is_file():
        raise ValueError(
            f"{directory} is a TensorFlow SavedModel (python -m export.saved_model), not an ONNX export; "
            "serve it with TensorFlow, or export ONNX with `python -m export.onnx`"
        )
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {CONFIG_FILE}; expected a directory written by `python -m export.onnx`"
        )
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not valid UTF-8 JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, found {type(config).__name__}")
    kind, version = config.get("format"), config.get("format_version")
    name, expected = contract.ONNX.name, contract.ONNX.version
    if kind is None:  # a directory of another kind has a config.json too: say which and what to do
        from export.ctranslate2_spec import is_ctranslate2_export
        from keras_transformer.presets import is_preset_directory

        if is_preset_directory(directory):
            raise ValueError(
                f"{directory} is a Keras preset directory, not an ONNX export; export it first: "
                f"python -m export.onnx --preset {directory} --output ONNX_DIR"
            )
        if is_ctranslate2_export(directory):
            raise ValueError(
                f"{directory} is a CTranslate2 model (python -m export.ctranslate2), not an ONNX export; serve it "
                f"with python -m export.serve --engine ctranslate2 --model {directory}, or ctranslate2.Translator"
            )
    if kind not in (name, None) or version != expected:
        raise ValueError(
            f"{config_path} is format {kind or name!r} version {version!r}; this version of export.runtime "
            f"reads {name!r} version {expected}. Export the model again with this version of export.onnx."
        )
    missing = [key for key in (*contract.FIXED_AXES, "cache_dtype") if key not in config]
    if missing:
        raise ValueError(f"{config_path} lacks {missing} (the sizes of the graphs' tensors); export the model again")
    graphs = config.get("graphs")
    # The step driver's graphs are there for the models the fused step covers: all of them or none.
    required = [name for name in contract.ONNX.graphs if name not in contract.STEP_DRIVER_GRAPHS]
    if isinstance(graphs, dict) and set(graphs) & set(contract.STEP_DRIVER_GRAPHS):
        required = list(contract.ONNX.graphs)
    if not isinstance(graphs, dict) or set(required) - set(graphs):
        raise ValueError(f"{config_path} must name the graphs {sorted(required)}; export the model again")
    for graph in required:
        path = directory / graphs[graph]
        if path.parent != directory or not path.is_file():
            raise FileNotFoundError(f"{directory} is missing {graphs[graph]} (the {graph} graph)")
    weights = config.get("weights")
    if weights is not None and (pathlib.Path(weights).name != weights or not (directory / weights).is_file()):
        raise FileNotFoundError(f"{directory} is missing {weights} (the weights every graph reads)")
    return config


# Providers whose use has been tried in this process: name -> whether it works.
_PROVIDER_WORKS = {}
_CPU_FALLBACK_SAID = False


def _provider_works(ort, provider, path):
    """Whether a session on `provider` can be created, tried once per process, quietly.

    onnxruntime-gpu lists CUDAExecutionProvider as available on machines
    where it cannot start (no GPU, or CUDA/cuDNN libraries of another
    version), and then logs a red error for every session it falls back on.
    The probe silences ONNX Runtime's logger for one attempt.
    """
    if provider not in _PROVIDER_WORKS:
        ort.set_default_logger_severity(4)
        try:
            options = ort.SessionOptions()
            options.log_severity_level = 4
            session = ort.InferenceSession(str(path), options, providers=[provider, CPU])
            _PROVIDER_WORKS[provider] = session.get_providers()[0] == provider
        except Exception:  # noqa: BLE001 - any failure means: not usable here
            _PROVIDER_WORKS[provider] = False
        finally:
            ort.set_default_logger_severity(2)
    return _PROVIDER_WORKS[provider]


def resolve_providers(providers=None, probe_path=None):
    """ONNX Runtime execution providers: CUDA first when it works, else CPU (said once).

    Args:
        providers: explicit providers (checked against the installed ones),
            or None to choose.
        probe_path: a small graph to try CUDA on (the choice is made once
            per process).
    """
    import onnxruntime as ort

    available = ort.get_available_providers()
    if providers is not None:
        providers = list(providers)
        names = [p[0] if isinstance(p, (tuple, list)) else p for p in providers]
        missing = [name for name in names if name not in available]
        if missing:
            raise ValueError(
                f"Execution provider(s) {missing} are not available; this onnxruntime has {available}"
            )
        return providers
    if CUDA in available:
        if probe_path is None or _provider_works(ort, CUDA, probe_path):
            return [CUDA, CPU]
        global _CPU_FALLBACK_SAID
        if not _CPU_FALLBACK_SAID:
            _CPU_FALLBACK_SAID = True
            logger.info("onnxruntime-gpu cannot use CUDA on this machine (no GPU or CUDA libraries); using the CPU")
    return [CPU]


def default_optimized_cache():
    """Where `python -m export.runtime` keeps optimised graphs unless told otherwise.

    `$KERAS_TRANSFORMER_CACHE/onnxruntime`, else `keras_transformer/onnxruntime`
    under `$XDG_CACHE_HOME` or `~/.cache`; None when there is no home
    directory to put it in. Never the export directory.
    """
    root = os.environ.get("KERAS_TRANSFORMER_CACHE")
    if not root:
        try:
            base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path("~/.cache").expanduser()
        except RuntimeError:  # no home directory
            return None
        root = pathlib.Path(base) / "keras_transformer"
    return pathlib.Path(root) / "onnxruntime"


def add_optimized_cache_arguments(parser):
    """`--optimized-cache DIR` / `--no-optimized-cache`, for the commands that serve an export (`optimized_cache`)."""
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--optimized-cache", default=None, metavar="DIR",
        help="keep ONNX Runtime's optimised graphs in DIR: later starts skip the optimisation (faster cold start); "
             "default: $KERAS_TRANSFORMER_CACHE/onnxruntime or ~/.cache/keras_transformer/onnxruntime",
    )
    cache.add_argument(
        "--no-optimized-cache", action="store_true", help="optimise the graphs at every start and write nothing",
    )


def optimized_cache(args):
    """The optimised-graph cache directory that `add_optimized_cache_arguments`' options name, or None."""
    return None if args.no_optimized_cache else args.optimized_cache or default_optimized_cache()


def _session_options(intra_op_threads=None):
    """ONNX Runtime session options.

    The thread pool does not spin: on a busy machine (a 2-core CPU shared
    with other work) spinning threads competed with the work for the cores
    and made generation 1.5-2.5x slower (see benchmarks/README.md); it does
    not change the CUDA execution provider. `intra_op_threads`: None is
    ONNX Runtime's default (one per physical core).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if intra_op_threads is not None:
        options.intra_op_num_threads = int(intra_op_threads)
    return options


# ONNX Runtime graph optimisations the sessions leave out. `SkipLayerNormFusion` turns the converted
# graphs' `Add` + `LayerNormalization` (each post-LN residual) into `SkipLayerNormalization`, whose
# CPU kernel took 4-6x their time from 16 rows up here (onnxruntime 1.32, one thread: 88 vs 18 us at
# [64, 256], 417 vs 66 us at [320, 256]; the int8 start graph at batch 16: 10.0 -> 8.8 ms).
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def new_session(path, options, providers):
    """`onnxruntime.InferenceSession` of the graph at `path` (or serialized, bytes) without the `DISABLED_OPTIMIZERS`."""
    import onnxruntime as ort

    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), options, providers=providers, disabled_optimizers=list(DISABLED_OPTIMIZERS))


class OptimizedGraphCache:
    """The optimised-graph cache of `OnnxSeq2Seq` (`optimized_cache`): its sessions' methods that read and write it.

    A base of `OnnxSeq2Seq`, whose attributes it reads: `directory`,
    `config`, `_graph_path(graph)`, `_requested` (the providers),
    `_session_options`, `_intra_op_threads` and `_optimized_cache` (the
    cache directory; set to None when it cannot be created).
    """

    def _optimized_path(self, graph):
        """Where the optimised copy of `graph` is cached for these files, this onnxruntime and these providers.

        `<graph>-<export>-<files>-<runtime>.onnx`: `<export>` names the graph
        file's path, `<files>` the graph and weights files (size,
        modification time), `<runtime>` onnxruntime's version, the providers
        and the optimisation level. A copy for other files or another
        runtime is never loaded (its name differs); writing a copy removes
        those of older files at the same path (`_keep_optimized`).
        """
        import hashlib

        import onnxruntime as ort

        def key(parts):
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]

        path = self._graph_path(graph)
        weights = self.config.get("weights")
        files = []
        for file in (path, self.directory / weights) if weights else (path,):
            stat = file.stat()
            files.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
        runtime = [ort.__version__, repr(self._requested), str(int(self._session_options.graph_optimization_level)),
                   repr(DISABLED_OPTIMIZERS)]
        return self._optimized_cache / f"{graph}-{key([str(path.resolve())])}-{key(files)}-{key(runtime)}.onnx"

    def _cached_session(self, graph):
        """A session on the cached optimised copy of `graph`, not optimised again; None when there is none."""
        import onnxruntime as ort

        cached = self._optimized_path(graph)
        if not cached.is_file():
            return None
        options = _session_options(self._intra_op_threads)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            return ort.InferenceSession(str(cached), options, providers=self._requested)
        except Exception as error:  # noqa: BLE001 - optimised again from the export
            logger.warning("Cannot load the cached %s (%s); optimising %s again", cached, error, graph)
            return None

    def _options_saving(self, graph):
        """Session options that also write the optimised graph, and the temporary path it is written to.

        Its weights go to a file of their own whose name the graph records
        (unique per process); the graph is renamed into place once the
        session exists (`_keep_optimized`), so a cached graph always has its
        weights. A cache directory that cannot be created is said once and
        the graph is optimised as without a cache: `(default options, None)`.
        """
        try:
            self._optimized_cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            logger.warning("Cannot create the optimised-graph cache %s (%s); optimising without it",
                           self._optimized_cache, error)
            self._optimized_cache = None
            return self._session_options, None
        final = self._optimized_path(graph)
        temporary = final.with_name(f".{final.stem}.{os.getpid()}.onnx")
        options = _session_options(self._intra_op_threads)
        options.optimized_model_filepath = str(temporary)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", f"{final.stem}.{os.getpid()}.weights"
        )
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        return options, temporary

    def _keep_optimized(self, graph, saved):
        """Renames the optimised graph written at `saved` into place; removes the copies of older files there.

        Older files: another graph or weights file at the same path (a new
        export in the same place). Copies of the same files for another
        onnxruntime or providers stay.
        """
        final = self._optimized_path(graph)
        try:
            os.replace(saved, final)  # complete: its weights are written first
        except OSError as error:
            logger.warning("Could not cache the optimised %s in %s: %s", graph, self._optimized_cache, error)
            return
        name, export, files, _ = final.stem.split("-")
        for old in final.parent.glob(f"{name}-{export}-*"):
            parts = old.name.split(".")[0].split("-")
            if old.suffix in (".onnx", ".weights") and len(parts) == 4 and parts[2] != files:
                try:
                    old.unlink()
                except OSError:
                    pass  # removed by another process; a copy of older files is never loaded anyway
