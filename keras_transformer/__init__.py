"""keras_transformer: the original Transformer (Vaswani et al., 2017) in Keras 3."""

__version__ = "0.1.0.dev0"

from keras_transformer import layers
from keras_transformer.model import TransformerModel

__all__ = ["TransformerModel", "layers", "__version__"]
