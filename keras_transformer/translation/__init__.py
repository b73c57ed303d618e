"""What a `Translator` is made of besides the class: result types, batching, languages, search, scoring, alignments.

`keras_transformer.translator` re-exports the public names it held before (`Hypothesis`, `TargetScore`,
`length_batches`, `bind_languages`, ...). No training framework is imported here.
"""
