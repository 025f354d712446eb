"""Words of captions: the GRU encoders' word vocabulary and ids, TF-IDF (HUSE 4.1.1) and
the salience of words in long texts."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


SENTENCE = re.compile(r"(?<=[.!?])\s+")


SPECIALS = ("<pad>", "<start>", "<end>", "<unk>")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def build_vocab(train_texts: Sequence[str], min_count: int) -> dict:
    """Word vocabulary from train texts: specials, then words by count (ties by name)."""
    counts = Counter(w for t in train_texts for w in words(t))
    kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return {"words": [*SPECIALS, *kept], "counts": [0] * len(SPECIALS) + [counts[w] for w in kept]}


def word_ids(text: str, index: dict[str, int]) -> np.ndarray:
    unk = index["<unk>"]
    return np.array(
        [index["<start>"], *(index.get(w, unk) for w in words(text)), index["<end>"]],
        dtype=np.int32,
    )


def fit_tfidf(train_texts: Sequence[str], max_terms: int) -> tuple[list[str], np.ndarray]:
    """Terms (most frequent ``max_terms`` in train) and smooth IDF weights, as sklearn's
    ``TfidfVectorizer(smooth_idf=True)``: idf = ln((1 + n) / (1 + df)) + 1."""
    df = Counter(w for t in train_texts for w in set(words(t)))
    terms = sorted(df, key=lambda w: (-df[w], w))[:max_terms]
    terms.sort()
    n = len(train_texts)
    idf = np.array([math.log((1 + n) / (1 + df[t])) + 1 for t in terms], dtype=np.float64)
    return terms, idf


def tfidf_vector(text: str, term_index: dict[str, int], idf: np.ndarray):
    """Sparse L2-normalised TF-IDF of one text: (sorted term indices, values)."""
    tf = Counter(term_index[w] for w in words(text) if w in term_index)
    if not tf:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    idx = np.array(sorted(tf), dtype=np.int32)
    values = np.array([tf[i] for i in idx], dtype=np.float64) * idf[idx]
    return idx, (values / np.linalg.norm(values)).astype(np.float32)


def word_salience(sentences: list[str]) -> tuple[list[str], list[float]]:
    """HUSE 4.1.1: the words of a text, in order, each scored by its TF-IDF in its own
    sentence, where the sentences of the text are the documents of the corpus (smooth
    IDF, as in :func:`fit_tfidf`)."""
    sentence_words = [words(s) for s in sentences]
    n = len(sentence_words)
    sf = Counter(w for ws in sentence_words for w in set(ws))
    text_words, scores = [], []
    for ws in sentence_words:
        tf = Counter(ws)
        for w in ws:
            text_words.append(w)
            scores.append(tf[w] * (math.log((1 + n) / (1 + sf[w])) + 1))
    return text_words, scores
