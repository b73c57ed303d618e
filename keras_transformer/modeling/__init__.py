"""What `TransformerModel` (`keras_transformer/model.py`) is made of besides the class.

- `args.py`: its constructor arguments, the allowed values and `check_model_args`;
- `cache.py`: `CachedDecoding`, the key/value cache and one cached decoder step (a mixin);
- `attention.py`: `AttentionWeights`, the attention weights for plots and word alignments (a mixin);
- `adapters.py`: `Adapters`, the LoRA adapters and int8 quantization (a mixin).

`keras_transformer.model` re-exports the public names; the old paths (`keras_transformer.model_args`,
`model_cache`, `model_attention`, `model_adapters`) re-export these modules.
"""
