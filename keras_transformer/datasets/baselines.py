"""Two reference points for the bundled corpus: copy and nearest-neighbour retrieval.

- copy: the English source is the "translation" (scores only the overlap of
  names, numbers and loanwords).
- retrieval: the German of the most similar English training sentence, with
  similarity the cosine of TF-IDF vectors of character n-grams (default 3- to
  5-grams within word boundaries) or of word n-grams. This is what a model must
  beat to show it does more than remember the training set.

Usage:

    python -m keras_transformer.datasets.baselines [--split test] [--analyzer char] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import unicodedata

import numpy as np
import sacrebleu
from scipy import sparse
from tqdm import tqdm

from keras_transformer import datasets

logger = logging.getLogger(__name__)

ANALYZERS = ("char", "word")
_WORD_RE = re.compile(r"\w+", re.UNICODE)


def _normalize(text):
    return unicodedata.normalize("NFC", text).lower()


def extract_ngrams(text, analyzer="char", ngram_range=(3, 5)):
    """Returns the list of n-grams of `text` (with repeats).

    Args:
        text: str.
        analyzer: "char" for character n-grams inside space-padded words, or
            "word" for n-grams of `\\w+` tokens.
        ngram_range: `(min_n, max_n)`, inclusive.
    """
    if analyzer not in ANALYZERS:
        raise ValueError(f"analyzer={analyzer!r}; allowed analyzers are {ANALYZERS}")
    min_n, max_n = ngram_range
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram_range={ngram_range!r} must satisfy 1 <= min_n <= max_n")
    words = _WORD_RE.findall(_normalize(text))
    grams = []
    if analyzer == "word":
        for n in range(min_n, max_n + 1):
            grams.extend(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
        return grams
    for word in words:
        padded = f" {word} "
        for n in range(min_n, max_n + 1):
            grams.extend(padded[i : i + n] for i in range(max(1, len(padded) - n + 1)))
    return grams


class TfidfRetriever:
    """Nearest-neighbour search by cosine similarity of TF-IDF vectors.

    Term frequency is sublinear (1 + log count); idf is smoothed as
    `log((1 + N) / (1 + df)) + 1`; rows are L2-normalised. Features unseen in
    the indexed documents are ignored at query time.

    Args:
        analyzer: "char" or "word" (see `extract_ngrams`).
        ngram_range: `(min_n, max_n)`.

    Example:

    >>> retriever = TfidfRetriever(analyzer="word", ngram_range=(1, 1))
    >>> retriever.fit(["open the file", "close the window"]).nearest(["close window"])
    array([1])
    """

    def __init__(self, analyzer="char", ngram_range=(3, 5)):
        if analyzer not in ANALYZERS:
            raise ValueError(f"analyzer={analyzer!r}; allowed analyzers are {ANALYZERS}")
        self.analyzer = analyzer
        self.ngram_range = tuple(ngram_range)
        self.vocabulary = None
        self.idf = None
        self.matrix = None

    def _counts(self, texts, grow):
        indptr, indices, values = [0], [], []
        for text in texts:
            counts = {}
            for gram in extract_ngrams(text, self.analyzer, self.ngram_range):
                index = self.vocabulary.get(gram)
                if index is None:
                    if not grow:
                        continue
                    index = self.vocabulary[gram] = len(self.vocabulary)
                counts[index] = counts.get(index, 0) + 1
            for index in sorted(counts):
                indices.append(index)
                values.append(counts[index])
            indptr.append(len(indices))
        return sparse.csr_matrix(
            (np.asarray(values, dtype=np.float32), np.asarray(indices, dtype=np.int64),
             np.asarray(indptr, dtype=np.int64)),
            shape=(len(texts), max(1, len(self.vocabulary))),
        )

    def _weight(self, counts):
        counts = counts.copy()
        counts.data = 1.0 + np.log(counts.data)
        weighted = counts @ sparse.diags(self.idf)
        norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1)).ravel())
        return sparse.diags(1.0 / np.maximum(norms, 1e-12)) @ weighted

    def fit(self, documents):
        """Indexes `documents` (list of str). Returns self."""
        self.vocabulary = {}
        counts = self._counts(documents, grow=True)
        document_frequency = np.bincount(counts.indices, minlength=counts.shape[1])
        self.idf = (np.log((1.0 + len(documents)) / (1.0 + document_frequency)) + 1.0).astype(
            np.float32
        )
        self.matrix = self._weight(counts).T.tocsc().astype(np.float32)  # [features, docs]
        logger.info("Indexed %d documents with %d %s n-gram features",
                    len(documents), len(self.vocabulary), self.analyzer)
        return self

    def nearest(self, queries, chunk_size=256, progress=False):
        """Returns the index of the most similar indexed document per query.

        Ties go to the lowest index; a query sharing no feature gets index 0.

        Args:
            queries: list of str.
            chunk_size: queries scored at once (memory: chunk_size x documents floats).
            progress: show a tqdm bar.

        Returns:
            int64 array of shape [len(queries)].
        """
        if self.matrix is None:
            raise RuntimeError("TfidfRetriever.nearest() called before fit()")
        query_matrix = self._weight(self._counts(queries, grow=False)).tocsr()
        result = np.zeros(len(queries), dtype=np.int64)
        starts = range(0, len(queries), chunk_size)
        for start in tqdm(starts, desc="retrieve", unit="chunk", disable=not progress):
            scores = (query_matrix[start : start + chunk_size] @ self.matrix).toarray()
            result[start : start + chunk_size] = scores.argmax(axis=1)
        return result


def retrieval_translations(train_source, train_target, queries, analyzer="char",
                           ngram_range=(3, 5), progress=False):
    """Translates each query as the target of its most similar training source.

    Args:
        train_source, train_target: aligned lists of str.
        queries: list of str in the source language.
        analyzer, ngram_range: see `TfidfRetriever`.

    Returns:
        A list of str, one training target per query.
    """
    if len(train_source) != len(train_target):
        raise ValueError(
            f"train_source has {len(train_source)} sentences but train_target has "
            f"{len(train_target)}; they must be aligned."
        )
    if not train_source:
        raise ValueError("train_source is empty; retrieval needs at least one pair.")
    retriever = TfidfRetriever(analyzer=analyzer, ngram_range=ngram_range).fit(train_source)
    return [train_target[i] for i in retriever.nearest(queries, progress=progress)]


def score(hypotheses, references):
    """Returns `{"bleu": float, "chrf": float, "bleu_signature": str, ...}` (sacreBLEU)."""
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(bleu_score.score, 2),
        "chrf": round(chrf_score.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def evaluate_baselines(split="test", analyzer="char", ngram_range=(3, 5)):
    """Scores the copy and retrieval baselines on a split of the bundled corpus.

    Returns:
        `{"split": ..., "pairs": n, "copy": {...}, "retrieval": {...}}` with the
        scores of `score`.
    """
    train_source, train_target = datasets.load_bundled("train")
    source, reference = datasets.load_bundled(split)
    copy = score(source, reference)
    retrieved = retrieval_translations(train_source, train_target, source, analyzer,
                                       ngram_range, progress=True)
    retrieval = score(retrieved, reference)
    retrieval["analyzer"] = analyzer
    retrieval["ngram_range"] = list(ngram_range)
    return {"split": split, "pairs": len(source), "copy": copy, "retrieval": retrieval}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="sacreBLEU and chrF of the copy and retrieval baselines on the bundled corpus."
    )
    parser.add_argument("--split", default="test", choices=datasets.SPLITS)
    parser.add_argument("--analyzer", default="char", choices=ANALYZERS)
    parser.add_argument("--ngram-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="n-gram sizes (default: 3 5 for char, 1 2 for word).")
    parser.add_argument("--json", action="store_true", help="Print a JSON object.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ngram_range = tuple(args.ngram_range or ((3, 5) if args.analyzer == "char" else (1, 2)))
    result = evaluate_baselines(args.split, args.analyzer, ngram_range)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['pairs']} {args.split} pairs of the bundled LibreOffice en-de corpus")
    for name in ("copy", "retrieval"):
        print(f"{name:>10}: BLEU {result[name]['bleu']:6.2f}  chrF {result[name]['chrf']:6.2f}")
    print(f"BLEU signature: {result['copy']['bleu_signature']}")
    print(f"chrF signature: {result['copy']['chrf_signature']}")


if __name__ == "__main__":
    main()
