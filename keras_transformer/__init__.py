"""keras_transformer: the original Transformer (Vaswani et al., 2017) in Keras 3."""

__version__ = "0.1.0.dev0"

from keras_transformer import layers
from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.model import TransformerModel
from keras_transformer.schedules import WarmupSchedule, WarmupScheduleCallback, warmup_learning_rate
from keras_transformer.tokenizer import Tokenizer, train_tokenizer
from keras_transformer.training import average_checkpoints
from keras_transformer.translator import Translator

__all__ = [
    "LabelSmoothedCrossEntropy",
    "Tokenizer",
    "Translator",
    "TransformerModel",
    "WarmupSchedule",
    "WarmupScheduleCallback",
    "__version__",
    "average_checkpoints",
    "layers",
    "train_tokenizer",
    "warmup_learning_rate",
]
