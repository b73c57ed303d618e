"""Documents: sentences, HTML and word alignments, around what the model translates.

- `sentences.py`: documents into sentences and back (`split_texts`, `cut_to_fit`, `Split`);
  this path was that module and exports its names;
- `markup.py`: HTML in, HTML out (`translate_html`, `Translator.translate(format="html")`);
- `alignment.py`: the word-alignment rule (`hard_alignment`, `word_alignment`, `WordAlignment`).

The old paths `keras_transformer.markup` and `keras_transformer.alignment` re-export the last two.
"""

from keras_transformer.documents.sentences import *  # noqa: F401,F403
