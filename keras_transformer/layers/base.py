"""What the encoder and decoder layers share: arguments, sub-layers, config."""

import keras

from keras_transformer.layers.arguments import check_layer_args, head_dims
from keras_transformer.layers.attention import MultiHeadAttention, clone_initializer
from keras_transformer.layers.dense import Dense
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.residual import residual_connection


class TransformerLayerBase(keras.layers.Layer):
    """Base of `TransformerEncoderLayer` and `TransformerDecoderLayer`.

    Stores and checks the constructor arguments both take, returns them
    from `get_config`, and builds the sub-layers both have: attention,
    LayerNorm, Dropout and the position-wise feed-forward network (paper
    equation 2). Not a layer to use on its own.

    Args: see `TransformerEncoderLayer`.
    """

    def __init__(
        self,
        intermediate_dim,
        num_heads,
        dropout=0.1,
        attention_dropout=0.0,
        activation="relu",
        layer_norm_epsilon=1e-5,
        key_dim=None,
        value_dim=None,
        normalize_first=False,
        attention_window=None,
        use_fused_attention=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_layer_args(intermediate_dim, num_heads, dropout, attention_dropout, key_dim, value_dim, attention_window)
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation = keras.activations.get(activation)
        self.layer_norm_epsilon = layer_norm_epsilon
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.normalize_first = normalize_first
        self.attention_window = attention_window
        self.use_fused_attention = use_fused_attention
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _dense(self, units, name, activation=None):
        return Dense(
            units,
            activation=activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )

    def _build_attention(self, name, query_shape, value_shape, attention_window=None):
        """The attention sub-layer `name` with its LayerNorm and Dropout, built."""
        key_dim, value_dim = head_dims(query_shape[-1], self.num_heads, self.key_dim, self.value_dim)
        attention = MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            dropout=self.attention_dropout,
            attention_window=attention_window,
            use_fused_attention=self.use_fused_attention,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name=name,
        )
        attention.build(query_shape, value_shape)
        setattr(self, name, attention)
        self._build_norm_and_dropout(name, query_shape)

    def _build_norm_and_dropout(self, name, sequence_shape):
        norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=f"{name}_layer_norm"
        )
        norm.build(sequence_shape)
        setattr(self, f"{name}_norm", norm)
        setattr(self, f"{name}_dropout", Dropout(self.dropout, dtype=self.dtype_policy, name=f"{name}_dropout"))

    def _build_feedforward(self, sequence_shape):
        # FFN(x) = max(0, x W1 + b1) W2 + b2 (paper equation 2).
        self.feedforward_intermediate = self._dense(
            self.intermediate_dim, "feedforward_intermediate_dense", activation=self.activation
        )
        self.feedforward_intermediate.build(sequence_shape)
        self.feedforward_output = self._dense(sequence_shape[-1], "feedforward_output_dense")
        self.feedforward_output.build(tuple(sequence_shape[:-1]) + (self.intermediate_dim,))
        self._build_norm_and_dropout("feedforward", sequence_shape)

    def _sublayer(self, name, x, sublayer, training):
        """`residual_connection` around `sublayer` with the norm and dropout built for `name`."""
        norm, dropout = getattr(self, f"{name}_norm"), getattr(self, f"{name}_dropout")
        return residual_connection(x, sublayer, norm, dropout, self.normalize_first, training)

    def _feedforward(self, x, training):
        return self._sublayer(
            "feedforward", x, lambda y: self.feedforward_output(self.feedforward_intermediate(y)), training
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "attention_dropout": self.attention_dropout,
                "activation": keras.activations.serialize(self.activation),
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "normalize_first": self.normalize_first,
                "attention_window": self.attention_window,
                "use_fused_attention": self.use_fused_attention,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config
