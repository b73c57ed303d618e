"""Transformer layers, each usable on its own and serializable."""

from keras_transformer.layers.attention import MultiHeadAttention
from keras_transformer.layers.decoder import TransformerDecoderLayer
from keras_transformer.layers.encoder import TransformerEncoderLayer
from keras_transformer.layers.position import LearnedPositionEmbedding, SinusoidalPositionEncoding

__all__ = [
    "LearnedPositionEmbedding",
    "MultiHeadAttention",
    "SinusoidalPositionEncoding",
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
]
