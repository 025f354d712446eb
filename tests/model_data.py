"""Small in-memory training data for model tests: demo captions, their gold scene graphs
and synthetic image features made from the demo's objects (no stores, no extraction).

``TinyPairs`` has ``PairData``'s interface (``info``, ``pair_batch``, ``image_batch``,
``text_batch``, ``caption_image``, ``n_images``, ``len``), so the training loop and
evaluation run on it unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from features.demo import SHAPES, DemoConfig, generate_image
from features.text.vocab import build_vocab, fit_tfidf, tfidf_vector, word_ids, words
from models.data.arrays import phrase_ids, scene_graph_batch
from models.data.info import DataInfo

IMAGE_DIM, REGION_DIM, GRID_DIM, TOKEN_DIM, DOC_DIM = 48, 32, 32, 24, 40
MAX_REGIONS, GRID_CELLS = 4, 4


def _graph_row(gold: dict) -> dict:
    """The demo's gold graph in the schema of ``scenegraphs.parquet``."""
    return {
        "objects": [{"span": o, "head": o, "lemma": o} for o in gold["objects"]],
        "attributes": [{"object": i, "attribute": a, "lemma": a} for i, a in gold["attributes"]],
        "relations": [
            {"subject": s, "relation": r, "lemma": r, "object": o} for s, r, o in gold["relations"]
        ],
    }


def pad_stack(values: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrays of different lengths along axis 0 -> ``(B, L_max, ...)`` zero-padded + lengths."""
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    padded = np.zeros((len(values), max(int(lengths.max(initial=0)), 1), *values[0].shape[1:]))
    padded = padded.astype(values[0].dtype)
    for i, v in enumerate(values):
        padded[i, : len(v)] = v
    return torch.from_numpy(padded), torch.from_numpy(lengths)


class TinyPairs:
    def __init__(self, n_images: int = 32, captions_per_image: int = 1, seed: int = 0):
        rng = np.random.default_rng(seed)
        cfg = DemoConfig(image_size=64)
        records = [generate_image(cfg, "train", i)[1] for i in range(n_images)]
        sentences = [r["sentences"][:captions_per_image] for r in records]
        self.captions = [s["raw"] for ss in sentences for s in ss]
        self.graphs = [_graph_row(s["scene_graph"]) for ss in sentences for s in ss]
        self.caption_image = np.repeat(np.arange(n_images), captions_per_image).astype(np.int64)
        self.n_images = n_images
        self.labels = np.array([r["label"] for r in records], dtype=np.int64)

        vocab = build_vocab(self.captions, 1)
        self.word_index = {w: i for i, w in enumerate(vocab["words"])}
        terms, self.idf = fit_tfidf(self.captions, 1000)
        self.term_index = {t: i for i, t in enumerate(terms)}

        # images: a random code per object name, summed, plus noise (regions: one per object)
        names = sorted({o["span"] for g in self.graphs for o in g["objects"]})
        codes = {n: rng.normal(size=REGION_DIM).astype(np.float32) for n in names}
        self.regions = np.zeros((n_images, MAX_REGIONS, REGION_DIM), np.float32)
        self.region_lengths = np.ones(n_images, np.int64)
        for i in range(n_images):
            objs = [o["span"] for o in self.graphs[i * captions_per_image]["objects"]]
            objs = objs[:MAX_REGIONS] or [names[0]]
            self.regions[i, : len(objs)] = [codes[o] for o in objs]
            self.region_lengths[i] = len(objs)
        self.regions += 0.1 * rng.normal(size=self.regions.shape).astype(np.float32)
        corners = np.sort(rng.uniform(size=(n_images, MAX_REGIONS, 2, 2)), axis=2)
        self.boxes = corners.reshape(n_images, MAX_REGIONS, 4)[..., [0, 1, 2, 3]].astype(np.float32)
        self.image = rng.normal(size=(n_images, IMAGE_DIM)).astype(np.float32)
        self.grid = rng.normal(size=(n_images, GRID_CELLS, GRID_DIM)).astype(np.float32)
        # "BERT" token features: a fixed random vector per word
        self.token_table = rng.normal(size=(len(vocab["words"]), TOKEN_DIM)).astype(np.float32)
        self.doc_proj = rng.normal(size=(TOKEN_DIM, DOC_DIM)).astype(np.float32)

        negatives = {"nouns": names, "adjectives": ["red", "blue", "huge"], "relations": ["on"]}
        self.info = DataInfo(
            image_dim=IMAGE_DIM,
            region_dim=REGION_DIM,
            grid_dim=GRID_DIM,
            token_dim=TOKEN_DIM,
            document_dim=DOC_DIM,
            vocab_size=len(vocab["words"]),
            tfidf_dim=len(terms),
            n_classes=len(SHAPES),
            class_distances=(0.8 * (1 - np.eye(len(SHAPES)))).tolist(),
            negatives={
                k: [phrase_ids(p, self.word_index) for p in v] for k, v in negatives.items()
            },
        )

    def __len__(self) -> int:
        return len(self.captions)

    def image_batch(self, images) -> dict:
        images = np.asarray(images)
        return {
            "image": torch.from_numpy(self.image[images]),
            "regions": torch.from_numpy(self.regions[images]),
            "region_lengths": torch.from_numpy(self.region_lengths[images]),
            "boxes": torch.from_numpy(self.boxes[images]),
            "grid": torch.from_numpy(self.grid[images]),
            "labels": torch.from_numpy(self.labels[images]),
        }

    def text_batch(self, captions) -> dict:
        captions = np.asarray(captions)
        texts = [self.captions[c] for c in captions]
        ids = [word_ids(t, self.word_index).astype(np.int64) for t in texts]
        tokens = [self.token_table[i[1:-1]] for i in ids]
        tfidf = np.zeros((len(texts), self.info.tfidf_dim), np.float32)
        for b, t in enumerate(texts):
            idx, val = tfidf_vector(t, self.term_index, self.idf)
            tfidf[b, idx] = val
        out = {}
        out["words"], out["word_lengths"] = pad_stack(ids)
        out["tokens"], out["token_lengths"] = pad_stack(tokens)
        out["document"] = torch.from_numpy(np.stack([t.mean(0) @ self.doc_proj for t in tokens]))
        out["tfidf"] = torch.from_numpy(tfidf)
        out["text_labels"] = torch.from_numpy(self.labels[self.caption_image[captions]])
        out.update(scene_graph_batch([self.graphs[c] for c in captions], self.word_index))
        return out

    def pair_batch(self, captions) -> dict:
        captions = np.asarray(captions, dtype=np.int64)
        return {
            **self.image_batch(self.caption_image[captions]),
            **self.text_batch(captions),
            "caption_image": torch.from_numpy(self.caption_image[captions]),
        }


def overfit(model, data: TinyPairs, steps: int, lr: float = 1e-3, seed: int = 0) -> float:
    """Train on all pairs as one batch for ``steps`` steps; returns i2t R@1 in percent."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batch = data.pair_batch(np.arange(len(data)))
    model.train()
    for step in range(steps):
        batch["epoch"] = step * 20 // steps  # walks through epoch-based schedules
        opt.zero_grad()
        loss = model.loss(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        opt.step()
    model.eval()
    with torch.no_grad():
        img = model.encode_image(data.image_batch(np.arange(data.n_images)))
        txt = model.encode_text(data.text_batch(np.arange(len(data))))
        sims = model.similarity(img, txt)
    best = sims.argmax(1).numpy()
    return 100.0 * float(np.mean(data.caption_image[best] == np.arange(data.n_images)))


__all__ = ["TinyPairs", "overfit", "words"]
