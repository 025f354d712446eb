"""Text features: vocabularies fitted on train, TF-IDF, BERT token and HUSE document
features (a small random-init BERT with the bundled WordPiece tokenizer), long texts."""

import json

import numpy as np
import pytest
import torch
from demo_data import demo_manifest
from transformers import AutoTokenizer, BertConfig, BertModel

from features.store.reader import Store
from features.store.spec import StoreConfig
from features.text.models import resolve_model
from features.text.stage import BertTexts, TextConfig, extract_text
from features.text.vocab import build_vocab, fit_tfidf, tfidf_vector, word_ids, word_salience, words


@pytest.fixture(scope="module")
def encoder():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"), local_files_only=True)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
    )
    return BertTexts(tokenizer, BertModel(config), 512, torch.device("cpu"))


def test_word_vocabulary_from_train_only():
    vocab = build_vocab(["a red circle", "a red square", "a blue circle"], min_count=2)
    assert vocab["words"] == ["<pad>", "<start>", "<end>", "<unk>", "a", "circle", "red"]
    index = {w: i for i, w in enumerate(vocab["words"])}
    assert word_ids("A red HEXAGON", index).tolist() == [1, 4, 6, 3, 2]


def test_tfidf_matches_scikit_learn():
    from sklearn.feature_extraction.text import TfidfVectorizer

    train = ["a red circle", "a red square above a circle", "the blue star", "a star"]
    terms, idf = fit_tfidf(train, max_terms=100)
    reference = TfidfVectorizer(token_pattern=r"[a-z0-9]+(?:'[a-z]+)?").fit(train)
    assert terms == list(reference.get_feature_names_out())
    np.testing.assert_allclose(idf, reference.idf_)
    index = {t: i for i, t in enumerate(terms)}
    text = "a red circle next to a red star"
    idx, values = tfidf_vector(text, index, idf)
    dense = np.zeros(len(terms))
    dense[idx] = values
    np.testing.assert_allclose(dense, reference.transform([text]).toarray()[0], rtol=1e-6)


def test_token_and_document_features(encoder):
    texts = ["a red circle above a blue square", "a star"]
    batch = encoder(texts)
    single = encoder(texts[1:])[0]
    ids = encoder.tokenizer(texts[1])["input_ids"]
    assert batch[1]["wordpiece_ids"].tolist() == ids  # [CLS] a star [SEP]
    np.testing.assert_allclose(batch[1]["features"], single["features"], atol=1e-5)
    with torch.no_grad():
        out = encoder.model(torch.tensor([ids]), output_hidden_states=True)
    four = torch.cat(out.hidden_states[-4:], dim=-1)[0]
    np.testing.assert_allclose(batch[1]["document"], four.mean(0).numpy(), atol=1e-5)
    np.testing.assert_allclose(batch[1]["features"], out.last_hidden_state[0].numpy(), atol=1e-5)
    assert batch[0]["document"].shape == (4 * 32,)


def test_long_texts_keep_their_most_salient_words(encoder):
    filler = "the recipe is easy. " * 30
    text = filler + "saffron saffron saffron risotto."
    short = BertTexts(encoder.tokenizer, encoder.model, 16, torch.device("cpu"))
    ids = short.token_ids(text)
    kept = short.tokenizer.decode(ids[1:-1])
    assert len(ids) <= 16 and "saffron" in kept and "risotto" in kept
    text_words, scores = word_salience(["a b b.", "a c."])
    assert text_words == ["a", "b", "b", "a", "c"]
    assert scores[1] > scores[4] > scores[0] == scores[3]  # b twice in one sentence; a everywhere


def test_extract_text_store(encoder, tmp_path):
    manifest = demo_manifest(tmp_path, n_train=6, n_val=2, n_test=2)
    cfg = TextConfig(word_min_count=1, batch_size=7)
    vocab = extract_text(
        manifest,
        encoder,
        cfg,
        "w" * 64,
        tmp_path / "t.zarr",
        tmp_path / "vocab.json",
        StoreConfig(samples_per_shard=8, samples_per_chunk=4),
        log=lambda m: None,
    )
    assert json.loads((tmp_path / "vocab.json").read_text()) == vocab
    store = Store.open(tmp_path / "t.zarr", kind="text", manifest_digest=manifest.digest)
    assert len(store) == 50 and store.keys[6] == "train_00001#1"
    sample = store["val_00000#2"]
    caption = manifest.split("val").to_pylist()[0]["captions"][2]
    assert sample["features"].shape == (len(sample["wordpiece_ids"]), 32)
    index = {w: i for i, w in enumerate(vocab["words"])}
    assert sample["word_ids"].tolist() == word_ids(caption, index).tolist()
    train_words = {
        w for r in manifest.split("train").to_pylist() for c in r["captions"] for w in words(c)
    }
    assert set(vocab["words"][4:]) == train_words  # fitted on train only
    assert store.verify() == []


def test_captions_with_non_finite_features_are_stored_invalid_and_reported(
    encoder, tmp_path, monkeypatch
):
    import features.text.stage as text

    real = text.encode_in_length_order

    def broken(encoder, texts, *args, **kwargs):
        results = real(encoder, texts, *args, **kwargs)
        for caption, result in zip(texts, results, strict=True):
            if caption.endswith("1"):
                result["features"][2, 3] = np.nan
            if caption.endswith("5"):
                result["document"][0] = 1e6  # finite as float32, infinite as float16
        return results

    monkeypatch.setattr(text, "encode_in_length_order", broken)
    keys, texts = [f"img{i}#0" for i in range(6)], [f"a caption number {i}" for i in range(6)]
    vocab = {**build_vocab(texts, 1), "tfidf_terms": ["a"], "idf": [1.0]}
    messages = []
    text.write_text_store(
        keys,
        texts,
        vocab,
        encoder,
        TextConfig(),
        "w" * 64,
        "m" * 64,
        tmp_path / "t.zarr",
        StoreConfig(samples_per_shard=4, samples_per_chunk=2),
        log=messages.append,
    )
    store = Store.open(tmp_path / "t.zarr")
    assert store.notes() == {
        "img1#0": ["non_finite", "features: NaN or infinite values"],
        "img5#0": ["non_finite", "document: NaN or infinite values"],
    }
    data = store.read(0, 6)
    assert data["valid"].tolist() == [1, 0, 1, 1, 1, 0]
    assert all(np.isfinite(f.astype(np.float32)).all() for f in data["features"])
    assert np.isfinite(data["document"].astype(np.float32)).all()
    assert any("2 captions stored empty" in m and "img1#0 (features)" in m for m in messages)
