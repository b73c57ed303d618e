"""TransformerModel: the encoder-decoder of "Attention Is All You Need".

Shape legend: B batch, S source length, T target length, D hidden_dim
(d_model), V vocabulary_size, L decoder layers, N heads, K/Vh per-head
key/value size (d_k, d_v).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_transformer import allocator, fused_training
from keras_transformer.checks import check_batch_sizes, check_token_ids
from keras_transformer.layers.dense import product_with_bias
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.decoder import TransformerDecoderLayer
from keras_transformer.layers.encoder import TransformerEncoderLayer
from keras_transformer.layers.position import LearnedPositionEmbedding, SinusoidalPositionEncoding
# The argument checks, the cached decoder step, the attention weights and the LoRA / int8 methods have their own
# modules in `modeling/` (the last three as mixins); the names below stay importable from here (plain re-exports).
from keras_transformer.modeling.adapters import Adapters
from keras_transformer.modeling.args import (  # noqa: F401 - re-exported
    ACTIVATIONS, POSITION_ENCODINGS, SINUSOID_LAYOUT, check_model_args,
)
from keras_transformer.modeling.attention import AttentionWeights
from keras_transformer.modeling.cache import _OUTPUT_KERNEL, CachedDecoding  # noqa: F401 - _OUTPUT_KERNEL re-exported
# Preset I/O lives in `presets` and Keras' export in `keras_export`; the names
# below stay importable from here (plain re-exports) for code written before.
from keras_transformer import keras_export
from keras_transformer.keras_export import PROJECT_EXPORTERS, tf2onnx_optimizers  # noqa: F401 - re-export
from keras_transformer.presets import (  # noqa: F401 - some re-exported
    PRESET_FORMAT_VERSION, PRESETS, PRETRAINED_PRESETS, QUANTIZED_PRESET_FORMAT_VERSION, READABLE_PRESET_FORMATS,
    TOKENIZER_FILE, constructor_args, load_preset_directory, upgrade_preset_config, write_preset,
)
from keras_transformer.quantization import check_quantization
from keras_transformer.tokenizers.sentencepiece import END_ID, PAD_ID, START_ID, UNK_ID

# On JAX, glibc keeps the CPU runtime's freed step buffers instead of unmapping them (`allocator`): done
# here, before the runtime starts, because an arena once given to its threads stays theirs.
allocator.configure_for_backend(keras.backend.backend())

# The forward pass's inputs, `[B, S]` and `[B, T]` int32 ids: what `build`
# records (for `summary`) and the signature of Keras' own `model.export`.
INPUT_NAMES = ("encoder_token_ids", "decoder_token_ids")


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerModel(CachedDecoding, AttentionWeights, Adapters, keras.Model):
    """The Transformer encoder-decoder (Vaswani et al., 2017).

    The paper's symbols map to the arguments as: N = `num_layers`,
    d_model = `hidden_dim`, d_ff = `intermediate_dim`, h = `num_heads`,
    d_k = `key_dim`, d_v = `value_dim`, P_drop = `dropout`.

    As in the paper: one embedding matrix is shared by the encoder input,
    the decoder input and the pre-softmax projection (section 3.4; with
    `source_vocabulary_size`, the encoder has its own table);
    embeddings are multiplied by sqrt(d_model); dropout is applied to the
    sums of embeddings and positions and to every sub-layer output;
    post-layer-normalisation unless `normalize_first=True`. Masks are derived
    from the padding id (0); callers never build them.

    Every variant of the paper's Table 3 is a constructor call: (A) `num_heads`
    with `key_dim`/`value_dim`, (B) `key_dim` (d_v stays hidden_dim //
    num_heads = 64), (C) `num_layers`, `hidden_dim`,
    `intermediate_dim`, `key_dim`/`value_dim`, (D) `dropout` (label smoothing
    lives in the loss), (E) `position_encoding="learned"`.

    Args:
        vocabulary_size: int, size of the shared source/target vocabulary
            (with `source_vocabulary_size`: of the target vocabulary, the
            decoder's embedding and the output projection).
        num_layers: int, encoder and decoder layers (N).
        num_heads: int, attention heads (h).
        hidden_dim: int, model size (d_model).
        intermediate_dim: int, feed-forward inner size (d_ff).
        key_dim: optional int, per-head query/key size (d_k);
            default `hidden_dim // num_heads`.
        value_dim: optional int, per-head value size (d_v); default
            `hidden_dim // num_heads`, independently of `key_dim`.
        dropout: float, P_drop.
        attention_dropout: float, dropout on attention weights (not in the
            paper, 0.0).
        max_sequence_length: int, longest source or target accepted.
        position_encoding: "sinusoidal" (paper: sines and cosines
            interleaved), "learned" (Table 3, row E), "sinusoidal_halves"
            (the same sinusoids, sines in the first half of the features and
            cosines in the second: the layout of Marian checkpoints), or
            "sinusoidal_fairseq" (fairseq's: halves, frequencies
            10000^(-i / (d_model/2 - 1)), positions counted from 2: NLLB-200
            and M2M-100 checkpoints).
        normalize_first: bool, pre-LN instead of the paper's post-LN; adds a
            final LayerNorm after each stack (as fairseq's pre-LN models,
            NLLB-200 and M2M-100, have).
        attention_window: optional odd int r, restricted self-attention
            (Table 1, "a neighborhood of size r centered around the
            respective output position"): encoder position i sees the r
            positions j with |i - j| <= (r - 1) / 2; decoder self-attention,
            causal too, sees the (r + 1) / 2 positions i - (r - 1) / 2, ..., i.
            Even r is refused (no center). Cross-attention is not restricted.
        layer_norm_epsilon: float.
        num_encoder_layers, num_decoder_layers: optional ints overriding
            `num_layers` for one side.
        use_fused_attention: bool, use `keras.ops.dot_product_attention`
            where it computes the same numbers.
        pad_id, unk_id, start_id, end_id: the tokenizer's special ids.
        activation: the feed-forward activation, "relu" (the paper's
            equation 2), or "gelu" / "silu" (= swish) for imported checkpoints.
        logits_bias: bool, add a learned bias `[V]` to the output logits (not
            in the paper; Marian's `final_logits_bias`). Defaults to False.
        exclude_start_logit: bool, `decode_step` (the search and scoring)
            gives the start id a logit of -inf, so it is outside the softmax.
            For an imported checkpoint whose decoder starts from one of its
            own tokens (NLLB-200: `</s>`): our added start id copies that
            token's embedding row, and would otherwise count it twice in the
            softmax's sum. Training (`call`) is unchanged. Defaults to False
            (the paper's start token is an ordinary row).
        source_vocabulary_size: optional int. None (the paper, the default):
            one matrix for both embeddings and the pre-softmax projection. An
            int: the encoder embeds its input with a table of its own
            `[source_vocabulary_size, D]`, and the `[vocabulary_size, D]`
            table is the decoder's and the output projection's (tied): Marian
            checkpoints with separate source and target vocabularies
            (`share_encoder_decoder_embeddings: false`). The special ids are
            the same in both vocabularies.

    Example:
    >>> model = TransformerModel.from_preset("tiny")
    >>> src = np.array([[5, 6, 7, 3, 0]])
    >>> tgt = np.array([[2, 8, 9, 0]])
    >>> model({"encoder_token_ids": src, "decoder_token_ids": tgt}).shape
    (1, 4, 1000)

    References:
    - Vaswani et al., "Attention Is All You Need", NeurIPS 2017, arXiv:1706.03762.
    """

    # The paper's architectures (random weights) and named pretrained checkpoints.
    presets = {name: preset["description"] for name, preset in {**PRESETS, **PRETRAINED_PRESETS}.items()}

    def __init__(
        self,
        vocabulary_size,
        num_layers=6,
        num_heads=8,
        hidden_dim=512,
        intermediate_dim=2048,
        key_dim=None,
        value_dim=None,
        dropout=0.1,
        attention_dropout=0.0,
        max_sequence_length=1024,
        position_encoding="sinusoidal",
        normalize_first=False,
        attention_window=None,
        layer_norm_epsilon=1e-5,
        num_encoder_layers=None,
        num_decoder_layers=None,
        use_fused_attention=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        start_id=START_ID,
        end_id=END_ID,
        activation="relu",
        logits_bias=False,
        exclude_start_logit=False,
        source_vocabulary_size=None,
        **kwargs,
    ):
        special_ids = {"pad_id": pad_id, "unk_id": unk_id, "start_id": start_id, "end_id": end_id}
        key_dim_resolved, value_dim_resolved = check_model_args(
            vocabulary_size, num_layers, num_heads, hidden_dim, intermediate_dim, key_dim, value_dim, dropout,
            attention_dropout, max_sequence_length, position_encoding, normalize_first, attention_window,
            layer_norm_epsilon, num_encoder_layers, num_decoder_layers, use_fused_attention, special_ids,
            activation=activation, logits_bias=logits_bias, exclude_start_logit=exclude_start_logit,
            source_vocabulary_size=source_vocabulary_size,
        )
        super().__init__(**kwargs)

        self.vocabulary_size = int(vocabulary_size)
        self.num_layers = int(num_layers)
        self.num_heads = num_heads
        self.hidden_dim = int(hidden_dim)
        self.intermediate_dim = intermediate_dim
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.max_sequence_length = int(max_sequence_length)
        self.position_encoding = position_encoding
        self.normalize_first = normalize_first
        self.attention_window = attention_window
        self.layer_norm_epsilon = layer_norm_epsilon
        self.num_encoder_layers = num_encoder_layers
        self.num_decoder_layers = num_decoder_layers
        self.use_fused_attention = use_fused_attention
        self.pad_id, self.unk_id, self.start_id, self.end_id = (int(i) for i in special_ids.values())
        self.activation = activation
        self.logits_bias = bool(logits_bias)
        self.exclude_start_logit = bool(exclude_start_logit)
        self.source_vocabulary_size = None if source_vocabulary_size is None else int(source_vocabulary_size)
        self.head_key_dim, self.head_value_dim = key_dim_resolved, value_dim_resolved
        self.tokenizer = None
        # Set by `enable_lora`; not in the config: a preset is always the merged model.
        self.lora_rank, self.lora_alpha, self.lora_targets = None, None, ()

        self._create_sublayers(key_dim_resolved, value_dim_resolved)
        # All sizes are in the config, so the model is built (and has its
        # weights, e.g. for count_params) as soon as it is constructed.
        # Keras records the input shapes given here (`summary`, export).
        self.build({name: (None, None) for name in INPUT_NAMES})

    def _create_sublayers(self, key_dim, value_dim):
        """The embeddings, position layers, dropouts, the two stacks and (pre-LN) the final norms."""
        # One matrix for both embeddings and the pre-softmax projection
        # (section 3.4). With inputs scaled by sqrt(d_model), N(0, d^-0.5)
        # gives unit-scale embeddings and unit-scale initial logits (as in
        # tensor2tensor and fairseq).
        self.token_embedding = keras.layers.ReversibleEmbedding(
            self.vocabulary_size,
            self.hidden_dim,
            tie_weights=True,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=self.hidden_dim**-0.5),
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        # Not in the paper: the encoder's own table, for checkpoints with a separate source vocabulary.
        self.source_token_embedding = None
        if self.source_vocabulary_size is not None:
            self.source_token_embedding = keras.layers.Embedding(
                self.source_vocabulary_size,
                self.hidden_dim,
                embeddings_initializer=keras.initializers.RandomNormal(stddev=self.hidden_dim**-0.5),
                dtype=self.dtype_policy,
                name="source_token_embedding",
            )
        if self.position_encoding in SINUSOID_LAYOUT:
            layout = SINUSOID_LAYOUT[self.position_encoding]
            position_layer = lambda name: SinusoidalPositionEncoding(  # noqa: E731
                self.max_sequence_length, layout=layout, dtype=self.dtype_policy, name=name
            )
        else:
            position_layer = lambda name: LearnedPositionEmbedding(  # noqa: E731
                self.max_sequence_length, dtype=self.dtype_policy, name=name
            )
        self.encoder_position = position_layer("encoder_position")
        self.decoder_position = position_layer("decoder_position")
        self.encoder_embedding_dropout = Dropout(self.dropout, dtype=self.dtype_policy, name="encoder_embedding_dropout")
        self.decoder_embedding_dropout = Dropout(self.dropout, dtype=self.dtype_policy, name="decoder_embedding_dropout")
        layer_args = dict(
            intermediate_dim=self.intermediate_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            layer_norm_epsilon=self.layer_norm_epsilon,
            key_dim=key_dim,
            value_dim=value_dim,
            normalize_first=self.normalize_first,
            attention_window=self.attention_window,
            use_fused_attention=self.use_fused_attention,
            activation=self.activation,
            dtype=self.dtype_policy,
        )
        self.encoder_layers = [
            TransformerEncoderLayer(**layer_args, name=f"encoder_layer_{i}")
            for i in range(self.num_encoder_layers or self.num_layers)
        ]
        self.decoder_layers = [
            TransformerDecoderLayer(**layer_args, name=f"decoder_layer_{i}")
            for i in range(self.num_decoder_layers or self.num_layers)
        ]
        if self.normalize_first:
            self.encoder_final_norm = keras.layers.LayerNormalization(
                epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="encoder_final_layer_norm"
            )
            self.decoder_final_norm = keras.layers.LayerNormalization(
                epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="decoder_final_layer_norm"
            )

    def __call__(self, *args, **kwargs):
        # NumPy inputs are checked before Keras converts them to backend
        # tensors: JAX (without x64) casts int64 to int32, so the id
        # 2**32 + 7 would reach `call` as 7. Tensors are checked in `call`.
        inputs = args[0] if args else kwargs.get("inputs")
        if isinstance(inputs, dict):
            ids = {name: inputs[name] for name in ("encoder_token_ids", "decoder_token_ids") if name in inputs}
            for name, value in ids.items():
                if isinstance(value, (np.ndarray, list, tuple)):
                    ids[name] = np.asarray(value)
                    size = self.encoder_vocabulary_size if name == "encoder_token_ids" else self.vocabulary_size
                    check_token_ids(ids[name], name, size)
            check_batch_sizes(**ids)
        return super().__call__(*args, **kwargs)

    def build(self, input_shape=None):
        """Creates every weight; the sizes come from the config, not `input_shape`.

        Args:
            input_shape: ignored beyond being recorded by Keras: a dict
                `{"encoder_token_ids": (B, S), "decoder_token_ids": (B, T)}`
                (the constructor passes `(None, None)` for both), or None.
        """
        if self.built:
            # The constructor built every weight; a later `model.build(...)`
            # (as for any Keras model) has nothing left to create.
            return
        sequence = (None, None, self.hidden_dim)
        self.token_embedding.build((None, None))
        if self.source_token_embedding is not None:
            self.source_token_embedding.build((None, None))
        self.encoder_position.build(sequence)
        self.decoder_position.build(sequence)
        # Dropout has no weights; built so that `summary` shows its shape.
        self.encoder_embedding_dropout.build(sequence)
        self.decoder_embedding_dropout.build(sequence)
        for layer in self.encoder_layers:
            layer.build(sequence)
        for layer in self.decoder_layers:
            layer.build(sequence, sequence)
        if self.normalize_first:
            self.encoder_final_norm.build(sequence)
            self.decoder_final_norm.build(sequence)
        if self.logits_bias and not hasattr(self, "logits_bias_weight"):
            # Not in the paper: Marian's `final_logits_bias`, added to the
            # logits of the shared pre-softmax projection.
            self.logits_bias_weight = self.add_weight(
                name="logits_bias", shape=(self.vocabulary_size,), initializer="zeros", dtype="float32"
            )
        self.built = True

    def export_input_signature(self):
        """The forward pass's inputs for Keras' `export`: int32 `[B, S]` and `[B, T]`, any B, S, T.

        Returns:
            a list with one dict of `keras.InputSpec` named as the inputs,
            so that the names reach the SavedModel signature and the ONNX graph.
        """
        return [{name: keras.InputSpec(shape=(None, None), dtype="int32", name=name) for name in INPUT_NAMES}]

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs):
        """Keras' export of the forward pass: token ids in, logits `[B, T, V]` out.

        As `keras.Model.export`, with `export_input_signature()` (any batch
        and lengths) as the default signature, so the model need not have
        been called. What works where: "tf_saved_model" on TensorFlow and
        JAX; "onnx" on TensorFlow, on JAX with jax2onnx installed, and on
        PyTorch only for the fixed shapes of an explicit `input_signature`.
        For translation (the search, its cache, the tokenizer) use the
        project's exporters, `python -m export.onnx` and
        `python -m export.saved_model`. A LoRA model is exported merged
        (`merge_lora`).

        Example:
        >>> model = TransformerModel.from_preset("tiny")
        >>> model.export("tiny.onnx", format="onnx")   # TensorFlow backend
        >>> import onnxruntime
        >>> session = onnxruntime.InferenceSession("tiny.onnx")
        >>> [i.name for i in session.get_inputs()]
        ['decoder_token_ids', 'encoder_token_ids']

        Raises:
            RuntimeError: one line naming the backend, the format and the
                project's exporter, where Keras cannot export this model
                (on PyTorch also an `input_signature` with a None size).
            ValueError: an `input_signature` of more than one entry (the
                model takes one dict).
        """
        if self.lora_enabled:  # served merged: the shapes and speed of the model without LoRA
            return self.merge_lora().export(filepath, format, verbose, input_signature, **kwargs)
        return keras_export.export(self, filepath, format, verbose, input_signature, **kwargs)

    # ------------------------------------------------------------------ #
    # Forward pass
    # ------------------------------------------------------------------ #
    @property
    def encoder_vocabulary_size(self):
        """The ids the encoder takes: `source_vocabulary_size`, or the shared `vocabulary_size`."""
        return self.source_vocabulary_size or self.vocabulary_size

    def _embed(self, token_ids, position_layer, dropout_layer, start_index=0, training=None, embedding=None):
        x = (self.token_embedding if embedding is None else embedding)(token_ids)  # [B, T, D]
        x = x * ops.cast(math.sqrt(self.hidden_dim), x.dtype)
        x = x + position_layer(x, start_index=start_index)
        return dropout_layer(x, training=training)

    def encode(self, encoder_token_ids, training=False):
        """Encoder outputs `[B, S, D]` for source ids `[B, S]` (pad id 0)."""
        encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", self.encoder_vocabulary_size)
        padding_mask = ops.not_equal(encoder_token_ids, self.pad_id)  # [B, S]
        x = self._embed(encoder_token_ids, self.encoder_position, self.encoder_embedding_dropout, training=training,
                        embedding=self.source_token_embedding)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=padding_mask, training=training)
        if self.normalize_first:
            x = self.encoder_final_norm(x)
        return x

    def _logits(self, x):
        if self.normalize_first:
            x = self.decoder_final_norm(x)
        # Pre-softmax projection with the shared embedding matrix; logits
        # are float32 even under mixed precision.
        entered = _OUTPUT_KERNEL.get()  # `transposed_output_kernel`'s [D, V] copy
        if entered is not None and entered[0] is self:
            logits = ops.matmul(x, entered[1])
        elif (self.logits_bias and keras.backend.backend() == "torch" and self.token_embedding.quantization_mode is None
              and keras.backend.standardize_dtype(x.dtype) == "float32"):
            # One product with the bias inside, not a second [B, T, V] tensor for the sum:
            # at an OPUS-MT vocabulary (58k) that tensor is the largest of a training step.
            embeddings = ops.convert_to_tensor(self.token_embedding.embeddings)  # [V, D]
            return product_with_bias(x, ops.transpose(embeddings), self.logits_bias_weight)  # float32 [B, T, V]
        elif (keras.backend.standardize_dtype(x.dtype) in ("bfloat16", "float16")
              and self.token_embedding.quantization_mode is None):
            # Mixed precision: the product in the compute dtype, as every other layer's (and as the fused
            # loss and `torch.autocast`'s `lm_head` compute it), then float32 logits. Keras' Embedding
            # does not autocast its matrix, so `reverse=True` multiplied bfloat16 outputs by the float32
            # matrix in float32: the step's largest products (forward and both gradients), which a CPU
            # with AMX runs about 4x faster in bfloat16 (the Quick start's step on such a CPU, 2026-12-07:
            # 290 of 1,630 ms of op time in float32).
            embeddings = ops.cast(self.token_embedding.embeddings, x.dtype)  # [V, D]
            logits = ops.matmul(x, ops.transpose(embeddings))
        else:
            logits = self.token_embedding(x, reverse=True)
        logits = ops.cast(logits, "float32")  # [B, T, V]
        if self.logits_bias:
            logits = logits + ops.cast(self.logits_bias_weight, "float32")
        return logits

    def decode(self, decoder_token_ids, encoder_outputs, encoder_token_ids, training=False):
        """Full (uncached) decoder: logits `[B, T, V]` for target ids `[B, T]`.

        Args:
            decoder_token_ids: `[B, T]` target ids, starting with the start id.
            encoder_outputs: `[B, S, D]` from `encode`.
            encoder_token_ids: `[B, S]` source ids (for the padding mask).
        """
        decoder_token_ids = check_token_ids(decoder_token_ids, "decoder_token_ids", self.vocabulary_size)
        encoder_token_ids = check_token_ids(encoder_token_ids, "encoder_token_ids", self.encoder_vocabulary_size)
        check_batch_sizes(
            encoder_token_ids=encoder_token_ids, encoder_outputs=encoder_outputs, decoder_token_ids=decoder_token_ids
        )
        encoder_padding_mask = ops.not_equal(encoder_token_ids, self.pad_id)
        decoder_padding_mask = ops.not_equal(decoder_token_ids, self.pad_id)
        x = self._embed(decoder_token_ids, self.decoder_position, self.decoder_embedding_dropout, training=training)
        for layer in self.decoder_layers:
            x = layer(
                x,
                encoder_outputs,
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                training=training,
            )
        if training and fused_training.active_step(self) is not None:
            # A fused training step: `compute_loss` projects and takes the loss in chunks.
            return self.decoder_final_norm(x) if self.normalize_first else x
        return self._logits(x)

    def call(self, inputs, training=None):
        if not isinstance(inputs, dict) or not {"encoder_token_ids", "decoder_token_ids"} <= set(inputs):
            received = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                "TransformerModel expects a dict with 'encoder_token_ids' and "
                f"'decoder_token_ids', received {received}"
            )
        encoder_outputs = self.encode(inputs["encoder_token_ids"], training=training)
        return self.decode(
            inputs["decoder_token_ids"], encoder_outputs, inputs["encoder_token_ids"], training=training
        )

    # ------------------------------------------------------------------ #
    # Training steps (fused_training: the output projection and the loss together)
    # ------------------------------------------------------------------ #
    # "auto" or True: fused wherever the compiled loss and metrics allow (fused_training.why_not_fused);
    # False: never (the logits, then the compiled loss).
    fuse_output_loss = "auto"

    def train_step(self, *args, **kwargs):
        with fused_training.step_scope(self):
            return super().train_step(*args, **kwargs)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        step = fused_training.active_step(self)
        if step is None:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return fused_training.compute_loss(self, step, y, y_pred, sample_weight)

    def compute_loss_and_updates(self, *args, **kwargs):
        # JAX's trainer only: the predictions leave the differentiated function as its output.
        loss, aux = super().compute_loss_and_updates(*args, **kwargs)
        step = fused_training.active_step(self)
        if step is not None and step.predictions is not None:
            aux = (aux[0], step.predictions, *aux[2:])
            step.predictions = None
        return loss, aux

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        step = fused_training.active_step(self)
        if step is not None and step.predictions is not None:
            y_pred = step.predictions  # [B, T] ids, not the hidden states the model returned
        return super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def generate(self, encoder_token_ids, *, options=None, **search_keywords):
        """Translates source ids with beam search (greedy for `beam_size=1`): `generation.generate`.

        Args:
            encoder_token_ids: int `[B, S]` source ids (tokens + end id, pad 0).
            options: None, or a `SearchOptions`.
            **search_keywords: instead of `options` (one or the other):
                `beam_size`, `length_penalty`, `max_extra_length`,
                `patience`, as in `SearchOptions`.

        Returns:
            int32 NumPy array `[B, L]`: start id, tokens, end id, then 0s.

        Example:
        >>> model = TransformerModel.from_preset("tiny")
        >>> model.generate(np.array([[5, 6, 7, 3]]), beam_size=4)[0, 0]
        2
        """
        from keras_transformer.generation import generate

        return generate(self, encoder_token_ids, options=options, **search_keywords)

    def generate_hypotheses(self, encoder_token_ids, *, target_prefix=None, compile=True, options=None,
                            **search_keywords):
        """The `num_hypotheses` best outputs per source, with scores: `generation.generate_hypotheses`.

        `options` or `**search_keywords` (any `SearchOptions` field; one or
        the other), `target_prefix` and `compile` as there.

        Returns:
            `Hypotheses(sequences [B, n, L], scores [B, n], log_probs [B, n])`, best first.
        """
        from keras_transformer.generation import generate_hypotheses

        return generate_hypotheses(
            self, encoder_token_ids, target_prefix=target_prefix, compile=compile, options=options, **search_keywords
        )

    # ------------------------------------------------------------------ #
    # Config, presets
    # ------------------------------------------------------------------ #
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "num_layers": self.num_layers,
                "num_heads": self.num_heads,
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "attention_dropout": self.attention_dropout,
                "max_sequence_length": self.max_sequence_length,
                "position_encoding": self.position_encoding,
                "normalize_first": self.normalize_first,
                "attention_window": self.attention_window,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "num_encoder_layers": self.num_encoder_layers,
                "num_decoder_layers": self.num_decoder_layers,
                "use_fused_attention": self.use_fused_attention,
                "pad_id": self.pad_id,
                "unk_id": self.unk_id,
                "start_id": self.start_id,
                "end_id": self.end_id,
                "activation": self.activation,
                "logits_bias": self.logits_bias,
            }
        )
        if self.exclude_start_logit:  # only when set: the presets and exports of every other model are unchanged
            config["exclude_start_logit"] = True
        if self.source_vocabulary_size is not None:  # likewise
            config["source_vocabulary_size"] = self.source_vocabulary_size
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("trainable",):
            config.pop(key, None)
        return cls(**config)

    @classmethod
    def from_preset(cls, preset, quantize=None, **overrides):
        """A built-in preset, a directory from `save_to_preset`, or a pretrained checkpoint.

        Args:
            preset: a name in `TransformerModel.presets` (an architecture with
                random weights, or a named pretrained checkpoint such as
                "opus_mt_en_de"), a directory written by `save_to_preset`, a
                Hugging Face checkpoint directory (`config.json` with
                `"model_type": "marian"`, `"m2m_100"` (NLLB-200) or `"fsmt"`,
                `model.safetensors`, the tokenizer files), or a handle
                "hf://org/name" (downloaded once into the Hugging Face cache;
                see `keras_transformer.convert`).
            **overrides: constructor arguments replacing the preset's
                (e.g. `vocabulary_size=32000`, `dropout=0.0`); a pretrained
                checkpoint takes only those that keep its weights' meaning
                (dropout, attention_dropout, use_fused_attention,
                max_sequence_length, dtype, name).
            quantize: None, or "int8": the model quantized after loading
                (`quantize`). A preset saved quantized is loaded int8 either way.

        Returns:
            the model; a preset directory's or checkpoint's tokenizer is
            `model.tokenizer` (None for an architecture preset).
        """
        check_quantization(quantize)
        model = cls._from_preset(preset, overrides)
        if quantize is not None and model.quantization != quantize:
            model.quantize(quantize)
        return model

    @classmethod
    def _from_preset(cls, preset, overrides):
        from keras_transformer.presets import load_preset

        return load_preset(cls, preset, overrides)

    def save_to_preset(self, directory, tokenizer=None, metadata=None, overwrite=False):
        """Writes config.json, model.weights.h5, the tokenizer and metadata.json.

        The directory is written next to its final place and renamed at the
        end, so a failure never leaves a partial preset.

        Args:
            directory: path to create.
            tokenizer: optional tokenizer with a `save(directory)` method;
                defaults to `self.tokenizer`.
            metadata: optional JSON-serializable dict (what trained it, on
                what, with what score).
            overwrite: replace an earlier preset there (or an empty
                directory); a directory of other files is refused.

        A LoRA model (`enable_lora`) is written merged (`merge_lora`): an
        ordinary preset, with no adapters in its config or weights. A
        quantized model (`quantize`) is written with its int8 weights and
        `"quantization": "int8"` in config.json (format 3).
        """
        if self.lora_enabled:
            return self.merge_lora().save_to_preset(directory, tokenizer, metadata, overwrite)
        write_preset(self, directory, tokenizer if tokenizer is not None else self.tokenizer, metadata, overwrite)
