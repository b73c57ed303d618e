"""Built-in presets: data, not code; and a preset directory's files (`is_preset_directory`, `jsonable_config`).

`PRESETS` are architectures (random weights). Each entry: `config`
(TransformerModel arguments), `description`, the paper's reference, and
`average_last`: how many of the last checkpoints `run_training` averages by
default (section 6.1: 5 for base, 20 for big).

`PRETRAINED_PRESETS` are trained checkpoints of the same architecture: each
entry's `handle` is a Hugging Face repository (`hf://org/name`), converted on
load by `keras_transformer.convert` (downloaded once, then read from the
Hugging Face cache).
Paper: Vaswani et al., "Attention Is All You Need",
NeurIPS 2017, arXiv:1706.03762; Table 3 lists base and big.
"""

import json
import pathlib

PAPER = "Vaswani et al. 2017, arXiv:1706.03762"

# A preset directory (`TransformerModel.save_to_preset`): the model's config, its weights, what made it.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"


def is_preset_directory(directory):
    """Whether `directory` holds a preset: its config.json and weights (any format version).

    Framework-free: the ONNX Runtime server names a preset given where an
    export is expected.
    """
    directory = pathlib.Path(directory)
    return (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def jsonable_config(config):
    """A Keras `get_config()` as plain JSON holds it; a dtype policy as its name, as a preset stores it.

    Framework-free: written into a preset's, an export's and a fine-tuning
    run's config, and read back as written.
    """
    config = dict(config)
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = config["dtype"].get("config", {}).get("name")
    return json.loads(json.dumps(config, default=str))


PRESETS = {
    "base": {
        "description": (
            "The paper's base model (Table 3): N=6, d_model=512, d_ff=2048, h=8, "
            "d_k=d_v=64, P_drop=0.1, shared 37000-token BPE vocabulary (EN-DE). Random init."
        ),
        "reference": PAPER + ", Table 3 'base'",
        "average_last": 5,
        "config": {
            "vocabulary_size": 37000,
            "num_layers": 6,
            "num_heads": 8,
            "hidden_dim": 512,
            "intermediate_dim": 2048,
            "dropout": 0.1,
            "max_sequence_length": 1024,
        },
    },
    "big": {
        "description": (
            "The paper's big model (Table 3) for EN-DE: N=6, d_model=1024, d_ff=4096, "
            "h=16, d_k=d_v=64, P_drop=0.3, shared 37000-token BPE vocabulary. Random init."
        ),
        "reference": PAPER + ", Table 3 'big' and section 6.1",
        "average_last": 20,
        "config": {
            "vocabulary_size": 37000,
            "num_layers": 6,
            "num_heads": 16,
            "hidden_dim": 1024,
            "intermediate_dim": 4096,
            "dropout": 0.3,
            "max_sequence_length": 1024,
        },
    },
    "big_en_fr": {
        "description": (
            "The paper's big model for EN-FR: as 'big' but P_drop=0.1 (section 6.1) and "
            "the 32000 word-piece vocabulary the paper used for EN-FR (section 5.1). Random init."
        ),
        "reference": PAPER + ", sections 5.1 and 6.1",
        "average_last": 20,
        "config": {
            "vocabulary_size": 32000,
            "num_layers": 6,
            "num_heads": 16,
            "hidden_dim": 1024,
            "intermediate_dim": 4096,
            "dropout": 0.1,
            "max_sequence_length": 1024,
        },
    },
    "small": {
        "description": (
            "CPU-sized model for the Quick start: N=3, d_model=256, d_ff=1024, h=4, "
            "P_drop=0.1, 8000-token vocabulary. Trains on the bundled corpus on a laptop CPU."
        ),
        "reference": "Not in the paper; the paper's architecture at a smaller size.",
        "average_last": 5,
        "config": {
            "vocabulary_size": 8000,
            "num_layers": 3,
            "num_heads": 4,
            "hidden_dim": 256,
            "intermediate_dim": 1024,
            "dropout": 0.1,
            "max_sequence_length": 256,
        },
    },
    "tiny": {
        "description": (
            "Test-sized model: N=2, d_model=64, d_ff=128, h=4, P_drop=0.1, "
            "1000-token vocabulary. Seconds per step on a CPU."
        ),
        "reference": "Not in the paper; for tests and smoke runs.",
        "average_last": 5,
        "config": {
            "vocabulary_size": 1000,
            "num_layers": 2,
            "num_heads": 4,
            "hidden_dim": 64,
            "intermediate_dim": 128,
            "dropout": 0.1,
            "max_sequence_length": 256,
        },
    },
}


OPUS_MT = (
    "OPUS-MT (Tiedemann & Thottingal 2020, Helsinki-NLP), trained with Marian on OPUS data; CC-BY 4.0. "
    "The paper's base size (6+6 layers, d_model 512, 8 heads, d_ff 2048) with Marian's departures: "
    "swish feed-forward activation, sin|cos-halves positions, a logits bias. Trained weights, "
    "downloaded once from the Hugging Face Hub."
)

PRETRAINED_PRESETS = {
    f"opus_mt_{source}_{target}": {
        "description": f"{names[0]} -> {names[1]}: {OPUS_MT}",
        "handle": f"hf://Helsinki-NLP/opus-mt-{source}-{target}",
        "reference": "Tiedemann & Thottingal, 'OPUS-MT - Building open translation services for the World', EAMT 2020",
        "average_last": 5,
    }
    for source, target, names in (
        ("en", "de", ("English", "German")),
        ("de", "en", ("German", "English")),
        ("en", "fr", ("English", "French")),
        ("fr", "en", ("French", "English")),
        ("en", "es", ("English", "Spanish")),
        ("es", "en", ("Spanish", "English")),
    )
}

NLLB_200 = (
    "NLLB-200 (NLLB Team, 'No Language Left Behind', 2022, Meta AI): 200 languages; CC-BY-NC 4.0 (non-commercial). "
    "fairseq's pre-LN Transformer (a LayerNorm after each stack, fairseq's sinusoids, relu) with a 256k-piece "
    "SentencePiece vocabulary; translate with source_language= and target_language= (e.g. 'eng_Latn', "
    "'fra_Latn'). Trained weights, downloaded once from the Hugging Face Hub."
)

PRETRAINED_PRESETS.update({
    f"nllb_200_{name}": {
        "description": f"NLLB-200 {size} parameters ({what}): {NLLB_200}",
        "handle": f"hf://facebook/nllb-200-{repository}",
        "reference": "NLLB Team et al., 'No Language Left Behind: Scaling Human-Centered Machine Translation', 2022",
        "average_last": 5,
    }
    for name, repository, size, what in (
        ("distilled_600m", "distilled-600M", "600M", "distilled"),
        ("distilled_1_3b", "distilled-1.3B", "1.3B", "distilled"),
    )
})
