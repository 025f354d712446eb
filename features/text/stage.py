"""Language features of every caption, in one caption-level store (keys ``<image>#<i>``,
fields: :func:`fields`): the frozen BERT last-layer output per WordPiece token, ``[CLS]`` and
``[SEP]`` included (CAMERA's text input, eq. 15), and their ids; HUSE's document feature
(Narayana et al., sec. 4.1.1: each token's last four layers concatenated, averaged over the
tokens); ``<start>`` words ``<end>`` in the word vocabulary (the GRU text encoders of
VSE++, MV-VSE, UniVSE); the caption's sparse, L2-normalised TF-IDF vector.

The word vocabulary (min count) and the TF-IDF vocabulary and IDF weights are fitted on
the train split only, and saved (``vocab.json``) beside the store. Texts longer than BERT's
512-token window (UPMC Food-101 pages) keep the WordPieces of their most salient words, in
text order (HUSE 4.1.1: :func:`features.text.vocab.word_salience`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from pydantic import Field

from features.store.spec import FieldSpec
from features.text.vocab import (
    SENTENCE,
    build_vocab,
    fit_tfidf,
    tfidf_vector,
    word_ids,
    word_salience,
)
from infra.config import Section
from infra.device import Device, autocast

TEXT_VERSION = "1"


class TextConfig(Section):
    """``text`` section of params.yaml."""

    model: str = "bert-base-uncased"  # a name or local folder; nothing is downloaded
    max_tokens: int = Field(512, ge=8)
    batch_size: int = Field(64, ge=1)
    device: Device = "auto"
    word_min_count: int = Field(4, ge=1)  # words seen fewer times in train are <unk>
    tfidf_max_terms: int = Field(10000, ge=1)


def fields(hidden: int) -> dict[str, FieldSpec]:
    return {
        "features": FieldSpec((hidden,), "float16", ragged=True),
        "wordpiece_ids": FieldSpec((), "int32", ragged=True),
        "document": FieldSpec((4 * hidden,), "float16"),
        "word_ids": FieldSpec((), "int32", ragged=True),
        "tfidf_indices": FieldSpec((), "int32", ragged=True),
        "tfidf_values": FieldSpec((), "float32", ragged=True),
        "valid": FieldSpec((), "uint8"),  # 0: features held NaN or infinite values
    }


class BertTexts:
    """A frozen BERT-style encoder: per text, last-layer token features, WordPiece ids and
    the HUSE document feature (mean over tokens of the last four layers, concatenated)."""

    def __init__(self, tokenizer, model, max_tokens: int, device):
        self.tokenizer, self.model = tokenizer, model.to(device).eval()
        self.max_tokens = min(max_tokens, getattr(tokenizer, "model_max_length", max_tokens))
        self.device = device
        self.hidden = model.config.hidden_size

    def token_ids(self, text: str) -> list[int]:
        """WordPiece ids with [CLS]/[SEP]; a text over the window keeps its salient words."""
        tok = self.tokenizer
        pieces = tok(text, add_special_tokens=False)["input_ids"]
        budget = self.max_tokens - 2
        if len(pieces) > budget:  # the pieces of the most salient words that fit, in text order
            text_words, salience = word_salience(SENTENCE.split(text))
            word_pieces = [tok(w, add_special_tokens=False)["input_ids"] for w in text_words]
            keep, used = set(), 0
            for i in sorted(range(len(text_words)), key=lambda i: (-salience[i], i)):
                if used + len(word_pieces[i]) <= budget:
                    keep.add(i)
                    used += len(word_pieces[i])
            pieces = [p for i in sorted(keep) for p in word_pieces[i]]
        return [tok.cls_token_id, *pieces, tok.sep_token_id]

    def __call__(self, texts: Sequence[str]) -> list[dict[str, np.ndarray]]:
        import torch  # here, not at import: the CLI reads TextConfig and should start fast

        ids = [self.token_ids(t) for t in texts]
        batch = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True)
        lengths = torch.tensor([len(i) for i in ids])
        mask = (torch.arange(batch.shape[1]) < lengths[:, None]).long()  # (B, L)
        with torch.no_grad(), autocast(self.device):
            out = self.model(
                input_ids=batch.to(self.device),
                attention_mask=mask.to(self.device),
                output_hidden_states=True,
            )
        last = out.hidden_states[-1].float().cpu()
        four = torch.cat([h.float() for h in out.hidden_states[-4:]], dim=-1).cpu()
        m = mask.unsqueeze(-1).float()
        document = (four * m).sum(1) / m.sum(1)  # (B, 4H): HUSE mean over tokens
        return [
            {
                "features": last[r, : len(i)].numpy(),
                "wordpiece_ids": np.array(i, np.int32),
                "document": document[r].numpy(),
            }
            for r, i in enumerate(ids)
        ]


def load_bert_texts(cfg: TextConfig) -> tuple[BertTexts, str]:
    """The ``text`` section's encoder, offline, and its weights digest (for fingerprints)."""
    from transformers import AutoModel, AutoTokenizer

    from features.text.models import model_digest, resolve_model
    from infra.device import resolve_device

    folder = resolve_model(cfg.model)
    encoder = BertTexts(
        AutoTokenizer.from_pretrained(folder, local_files_only=True),
        AutoModel.from_pretrained(folder, local_files_only=True),
        cfg.max_tokens,
        resolve_device(cfg.device),
    )
    return encoder, model_digest(folder)


def encode_in_length_order(
    encoder: Callable[[Sequence[str]], list[dict]], texts: Sequence[str], batch_size: int
) -> list[dict]:
    """Run ``encoder`` on batches of texts of similar length in characters (less padding),
    results in text order."""
    order = np.argsort([len(t) for t in texts], kind="stable")
    results: list[dict | None] = [None] * len(texts)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        for i, result in zip(chosen, encoder([texts[i] for i in chosen]), strict=True):
            results[i] = result
    return results  # type: ignore[return-value]


def extract_text(
    manifest,
    encoder: BertTexts,
    cfg: TextConfig,
    weights: str,
    store_path,
    vocab_path,
    store_cfg,
    log: Callable[[str], None] = print,
    progress: Callable | None = None,
) -> dict:
    """Stage ``text``: fit the vocabularies on train, write them to ``vocab_path`` and fill
    the caption-level text store (resumable); returns the vocabularies."""
    from infra.files import write_json

    keys, texts, splits = manifest.caption_rows()
    train = [t for t, s in zip(texts, splits, strict=True) if s == "train"]
    vocab = build_vocab(train, cfg.word_min_count)
    terms, idf = fit_tfidf(train, cfg.tfidf_max_terms)
    vocab = {**vocab, "tfidf_terms": terms, "idf": [round(float(v), 6) for v in idf]}
    write_text_store(
        keys,
        texts,
        vocab,
        encoder,
        cfg,
        weights,
        manifest.digest,
        store_path,
        store_cfg,
        log=log,
        progress=progress,
    )
    write_json(vocab_path, vocab, indent=None)
    return vocab


def write_text_store(
    keys: Sequence[str],
    texts: Sequence[str],
    vocab: dict,
    encoder: BertTexts,
    cfg: TextConfig,
    weights: str,
    manifest_digest: str,
    store_path,
    store_cfg,
    *,
    kind: str = "text",
    log: Callable[[str], None] = print,
    progress: Callable | None = None,
) -> None:
    """Encode ``texts`` into a caption-level store with the given (train-fitted) word and
    TF-IDF vocabularies, so other caption sets (e.g. adversarial ones) share them.

    A caption whose features hold NaN or infinite values (as stored: float16 overflows
    count) is stored with zeros and ``valid = 0``, noted by key in its shard's commit marker
    (``Store.notes()``) and reported."""
    from features.store.spec import Provenance
    from features.store.writer import StoreWriter
    from infra.finite import NON_FINITE, nonfinite_fields

    word_index = {w: i for i, w in enumerate(vocab["words"])}
    term_index = {t: i for i, t in enumerate(vocab["tfidf_terms"])}
    idf = np.asarray(vocab["idf"], dtype=np.float64)
    params = cfg.model_dump(exclude={"batch_size", "device", "model"})
    provenance = Provenance(f"{kind}-bert", TEXT_VERSION, params, weights, manifest_digest)
    bar = progress(total=len(texts)) if progress else None
    store_fields = fields(encoder.hidden)
    dtypes = {name: spec.dtype for name, spec in store_fields.items()}
    bad: dict[str, list[str]] = {}
    with StoreWriter(
        store_path, kind, store_fields, list(keys), provenance, store_cfg, log=log
    ) as writer:
        for shard in writer.pending_shards():
            lo, hi = writer.shard_range(shard)
            chunk = texts[lo:hi]
            encoded = encode_in_length_order(encoder, chunk, cfg.batch_size)
            sparse = [tfidf_vector(t, term_index, idf) for t in chunk]
            valid = np.ones(hi - lo, np.uint8)
            notes = {}
            for i, (e, (indices, values)) in enumerate(zip(encoded, sparse, strict=True)):
                dense = {"features": e["features"], "document": e["document"]}
                wrong = nonfinite_fields({**dense, "tfidf_values": values}, dtypes)
                if wrong:  # stored empty and reported, like a bad image
                    e.update({k: np.zeros_like(v) for k, v in dense.items()})
                    sparse[i] = (indices, np.zeros_like(values))
                    valid[i] = 0
                    reason = f"{', '.join(wrong)}: NaN or infinite values"
                    notes[keys[lo + i]] = [NON_FINITE, reason]
                    bad[keys[lo + i]] = wrong
            writer.write_shard(
                shard,
                {
                    "features": [e["features"] for e in encoded],
                    "wordpiece_ids": [e["wordpiece_ids"] for e in encoded],
                    "document": np.stack([e["document"] for e in encoded]),
                    "word_ids": [word_ids(t, word_index) for t in chunk],
                    "tfidf_indices": [i for i, _ in sparse],
                    "tfidf_values": [v for _, v in sparse],
                    "valid": valid,
                },
                notes,
            )
            if bar is not None:
                bar.update(hi - lo)
    if bar is not None:
        bar.close()
    if bad:
        listing = ", ".join(f"{k} ({', '.join(v)})" for k, v in list(bad.items())[:10])
        log(
            f"{kind}: {len(bad)} captions stored empty (valid = 0): NaN or infinite features: "
            f"{listing}{', ...' if len(bad) > 10 else ''} (Store.notes() lists them all)"
        )
