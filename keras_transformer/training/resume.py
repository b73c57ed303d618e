"""Resume points: the one file from which a killed run continues where it was.

`save_resume_point` writes the weights, the optimizer state, the finished
intervals and what draws the dropout masks as one file, atomically;
`load_resume_point` restores them; `ResumePoint` writes one at the end of each
interval of `fit`. `RESUMABLE_CHANGES`: what a resumed run may change.
"""

import base64
import json
import os
import pathlib

import h5py
import keras
import numpy as np

from keras_transformer import lora
from keras_transformer.training.errors import OutputDirectoryError
from keras_transformer.utils import atomic_path

RESUME_FILE = "resume.weights.h5"  # in training/backup/
RESUME_ATTRIBUTE = "keras_transformer_resume"
RANDOM_STATE = "random_state"  # in the resume point: what draws the dropout masks (`_random_state`)
# Arguments that may differ when an interrupted run is resumed: they do not
# change what was already trained (the total length may grow or shrink down
# to what is done). Every other recorded argument must be repeated as given.
RESUMABLE_CHANGES = (
    "steps", "epochs", "keep_checkpoints", "average_last", "checkpoint_every_minutes", "strategy", "jit_compile",
    "bleu_beam_size", "validation_bleu", "validation_bleu_sentences",
)


def save_resume_point(model, path, intervals, **info):
    """Writes the weights, the optimizer state and the number of finished intervals as one file.

    The file is written under a temporary name and renamed, so a kill leaves
    either the previous resume point or this one, never a mixture (Keras'
    `BackupAndRestore` writes its weights in place and the epoch in a second
    file).
    """
    state = {"intervals": int(intervals), "step": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
             RANDOM_STATE: _random_state(model), **info}
    with atomic_path(path, suffix=".weights.h5") as temporary:
        model.save_weights(temporary, overwrite=True)
        with h5py.File(temporary, "r+") as handle:
            handle.attrs[RESUME_ATTRIBUTE] = json.dumps(state)
            lora.save_resume_state(model, handle)  # a LoRA model's frozen kernels and adapters, unmerged


def _seed_state_variables(model):
    """The state variable of each of the model's `SeedGenerator`s (the dropouts'), in the model's order.

    In order, not by path: a path holds names numbered across the process
    (`seed_generator_14`), which another process or model numbers otherwise.
    """
    return [variable for variable in model.non_trainable_variables if variable.name == "seed_generator_state"]


def _random_state(model):
    """What draws the dropout masks: the `SeedGenerator` states, and on PyTorch torch's own generators.

    Keras' PyTorch backend runs an unseeded `Dropout` with
    `torch.nn.functional.dropout`, which draws from torch's global generator
    (CPU, and each CUDA device's), not from the layer's `SeedGenerator`.
    """
    state = {"seed_generators": [[int(x) for x in keras.ops.convert_to_numpy(variable)]
                                 for variable in _seed_state_variables(model)]}
    if keras.backend.backend() == "torch":
        import torch

        def encode(tensor):
            return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")

        state["torch"] = encode(torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [encode(tensor) for tensor in torch.cuda.get_rng_state_all()]
    return state


def _restore_seed_generators(model, state, path):
    variables = _seed_state_variables(model)
    saved = state.get("seed_generators", [])
    if len(saved) != len(variables):
        # load_weights accepted the weights, so the architecture is the saved one.
        raise OutputDirectoryError(f"The resume point {path} holds {len(saved)} dropout random states and the "
                                   f"model {len(variables)}; pass --overwrite to start again")
    for values, variable in zip(saved, variables):
        variable.assign(np.asarray(values, dtype=variable.dtype))


def _restore_torch_generators(state):
    if keras.backend.backend() != "torch" or "torch" not in state:
        return
    import torch

    def decode(text):
        return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())

    torch.set_rng_state(decode(state["torch"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(text) for text in state["torch_cuda"]])


def load_resume_point(model, path):
    """Restores what `save_resume_point` wrote into a model built and compiled as the saved one.

    The weights and the optimizer state (Keras' `load_weights`), and the
    dropouts' `SeedGenerator` states, which Keras' weight files leave out
    (`Layer.save_own_variables` skips them): without them a resumed run drew
    step 0's dropout masks again, and its weights left an uninterrupted
    run's. On PyTorch the masks come from torch's generators, which `fit`
    itself draws from before its first step (its symbolic build runs the
    model): pass the returned state to `ResumePoint(..., random_state=)`,
    which restores them before the first step. A resume point written before
    the random state was kept restores weights and optimizer only.

    Returns:
        The saved random state (`RANDOM_STATE`), or None for an older resume point.
    """
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    with h5py.File(path, "r") as handle:
        lora_state = lora.read_resume_state(model, handle, path)  # a LoRA model's W, A and B, checked
    model.load_weights(str(path))
    lora.restore_resume_state(lora_state)  # over the merged kernels that load_weights set
    state = read_resume_point(path).get(RANDOM_STATE)
    if state is not None:
        _restore_seed_generators(model, state, path)
    return state


def read_resume_point(path):
    """The dict stored by `save_resume_point`, or None when `path` holds none."""
    if not os.path.isfile(path):
        return None
    try:
        with h5py.File(path, "r") as handle:
            return json.loads(handle.attrs[RESUME_ATTRIBUTE])
    except (OSError, KeyError, ValueError) as error:
        # Written atomically, so only a damaged disk or a foreign file gets here.
        raise OutputDirectoryError(
            f"The resume point {path} is unreadable ({error}); the checkpoints beside it are in "
            f"{pathlib.Path(path).parent.parent / 'checkpoints'}. Pass --overwrite to start again"
        ) from None


class ResumePoint(keras.callbacks.Callback):
    """Saves a resume point (`save_resume_point`) at the end of every interval ("epoch" of `fit`).

    `random_state`: what `load_resume_point` returned, when this `fit`
    continues from a resume point: torch's generators are set to it before
    the first step, where the uninterrupted run had them after writing the
    resume point (the `SeedGenerator` states were restored by the load).
    A new `fit` draws from torch's generator before its first step (its
    symbolic build runs the model; its data loader draws a base seed), and
    the uninterrupted run's `fit`, going on, did not.
    """

    def __init__(self, path, random_state=None):
        super().__init__()
        self.path = pathlib.Path(path)
        self.random_state = random_state

    def on_train_batch_begin(self, batch, logs=None):
        if self.random_state is not None:
            _restore_torch_generators(self.random_state)
            self.random_state = None

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            return  # StopOnNaN reports it; resuming from NaN weights would not help
        save_resume_point(self.model, self.path, epoch + 1, loss=None if loss is None else float(loss))
