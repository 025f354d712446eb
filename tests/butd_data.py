"""Bottom-up-attention checkpoints in the key layouts of the published files, with seeded
random values, for tests: py-bottom-up-attention's detectron2 conversions (``.pkl``: a
pickle of ``{"model": {name: numpy array}, "__author__": ...}``) and MILVLG's ``.pth``.

The keys are enumerated here from the two projects' module names (detectron2's ResNet
``backbone.stem/res2..res4``, ``proposal_generator.rpn_head``, ``roi_heads.res5``,
``roi_heads.box_predictor``), not taken from the project's model, so a model whose names
or shapes drift from the real files fails to load them. ``blocks``/``width`` give a
reduced network (the real one: (3, 4, 23, 3), 64)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def _norm(rng, prefix: str, c: int, stats: bool) -> dict:
    out = {
        prefix + "norm.weight": rng.uniform(0.5, 1.5, c),
        prefix + "norm.bias": rng.normal(0, 0.1, c),
    }
    if stats:
        out[prefix + "norm.running_mean"] = rng.normal(0, 0.1, c)
        out[prefix + "norm.running_var"] = rng.uniform(0.5, 1.5, c)
    return out


def _conv(rng, prefix: str, cout: int, cin: int, k: int, stats: bool) -> dict:
    w = rng.normal(0, np.sqrt(2.0 / (cin * k * k)) * 0.7, (cout, cin, k, k))
    return {prefix + "weight": w, **_norm(rng, prefix, cout, stats)}


def _stage(rng, prefix: str, n: int, cin: int, mid: int, stats: bool) -> dict:
    out = {}
    for j in range(n):
        p = f"{prefix}.{j}."
        if j == 0:
            out.update(_conv(rng, p + "shortcut.", 4 * mid, cin, 1, stats))
        out.update(_conv(rng, p + "conv1.", mid, cin if j == 0 else 4 * mid, 1, stats))
        out.update(_conv(rng, p + "conv2.", mid, mid, 3, stats))
        out.update(_conv(rng, p + "conv3.", 4 * mid, mid, 1, stats))
    return out


def butd_state(
    layout: str = "detectron2",
    blocks=(1, 1, 1, 1),
    width: int = 8,
    hidden: int = 32,
    classes: int = 31,  # with background
    attrs: int = 11,  # with "no attribute"; 0: no attribute head
    seed: int = 0,
    stats: bool = True,
) -> dict[str, np.ndarray]:
    """A float32 state dict in ``layout`` (``detectron2`` or ``milvlg``)."""
    rng = np.random.default_rng(seed)
    w = width
    s = _conv(rng, "backbone.stem.conv1.", w, 3, 7, stats)
    s["backbone.stem.conv1.weight"] *= 1 / 60.0  # inputs are 0..255 minus means
    s.update(_stage(rng, "backbone.res2", blocks[0], w, w, stats))
    s.update(_stage(rng, "backbone.res3", blocks[1], 4 * w, 2 * w, stats))
    s.update(_stage(rng, "backbone.res4", blocks[2], 8 * w, 4 * w, stats))
    s.update(_stage(rng, "roi_heads.res5", blocks[3], 16 * w, 8 * w, stats))
    rpn = "proposal_generator.rpn_head."
    per_anchor = 1 if layout == "detectron2" else 2
    s[rpn + "conv.weight"] = rng.normal(0, 0.05, (hidden, 16 * w, 3, 3))
    s[rpn + "conv.bias"] = rng.normal(0, 0.1, hidden)
    s[rpn + "objectness_logits.weight"] = rng.normal(0, 0.5, (12 * per_anchor, hidden, 1, 1))
    s[rpn + "objectness_logits.bias"] = rng.normal(0, 0.5, 12 * per_anchor)
    s[rpn + "anchor_deltas.weight"] = rng.normal(0, 0.01, (48, hidden, 1, 1))
    s[rpn + "anchor_deltas.bias"] = rng.normal(0, 0.05, 48)
    d = 32 * w
    box = "roi_heads.box_predictor."
    s[box + "cls_score.weight"] = rng.normal(0, 1.0 / np.sqrt(d) * 4, (classes, d))
    s[box + "cls_score.bias"] = rng.normal(0, 0.5, classes)
    reg = classes - 1 if layout == "detectron2" else classes
    s[box + "bbox_pred.weight"] = rng.normal(0, 0.001, (4 * reg, d))
    s[box + "bbox_pred.bias"] = np.zeros(4 * reg)
    if attrs:
        emb, fc, score = ("cls_embedding.", "fc_attr.", "attr_score.")
        if layout == "milvlg":
            emb, fc, score = ("cls_embed.", "attr_linear1.", "attr_linear2.")
        s[box + emb + "weight"] = rng.normal(0, 1.0, (classes, d // 8))
        s[box + fc + "weight"] = rng.normal(0, 1.0 / np.sqrt(d), (d // 4, d + d // 8))
        s[box + fc + "bias"] = rng.normal(0, 0.1, d // 4)
        s[box + score + "weight"] = rng.normal(0, 4.0 / np.sqrt(d), (attrs, d // 4))
        s[box + score + "bias"] = rng.normal(0, 0.5, attrs)
    return {k: np.asarray(v, dtype=np.float32) for k, v in s.items()}


def peaked_head(
    state: dict[str, np.ndarray],
    features: np.ndarray,
    seed: int = 0,
    sharpness: float = 5.0,
    attr_sharpness: float = 5.0,
) -> dict[str, np.ndarray]:
    """``state`` (detectron2 layout, with the attribute head) with the class and attribute
    heads rewritten so that, on region features like ``features`` (N, D), they score as a
    trained model's do: one class clearly wins per region, and the winning class and
    attribute change from region to region.

    A random head on raw features does not: the features are ReLU means, with a large
    common part, so one class wins everywhere with a near-uniform softmax. Here each head
    reads the features standardised per channel with the statistics of ``features``,
    z = (v - mean) / std (folded into its weights and bias): class logits are random
    projections of z of standard deviation about ``sharpness`` (background a constant -2),
    the attribute layer mixes z with the class embedding, and the attribute logits have
    a spread of about ``attr_sharpness``."""
    rng = np.random.default_rng(seed)
    box = "roi_heads.box_predictor."
    out = dict(state)
    classes, d = state[box + "cls_score.weight"].shape
    hidden, d_in = state[box + "fc_attr.weight"].shape
    embed, attrs = d_in - d, state[box + "attr_score.weight"].shape[0]
    f = np.asarray(features, np.float64).reshape(-1, d)
    mean, std = f.mean(0), f.std(0)
    std = np.maximum(std, 0.1 * np.median(std))  # near-dead channels: no blow-up
    w = rng.normal(0, sharpness / np.sqrt(d), (classes - 1, d)) / std  # acts on z
    out[box + "cls_score.weight"] = np.concatenate([w, np.zeros((1, d))])  # background last
    out[box + "cls_score.bias"] = np.append(-w @ mean, -2.0)
    out[box + "cls_embedding.weight"] = rng.normal(0, 1.0, (classes, embed))
    wz = rng.normal(0, 1 / np.sqrt(d), (hidden, d)) / std
    we = rng.normal(0, 1 / np.sqrt(embed), (hidden, embed))
    out[box + "fc_attr.weight"] = np.concatenate([wz, we], axis=1)
    out[box + "fc_attr.bias"] = -wz @ mean
    out[box + "attr_score.weight"] = rng.normal(
        0, attr_sharpness / np.sqrt(hidden), (attrs, hidden)
    )
    out[box + "attr_score.bias"] = np.zeros(attrs)
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def to_milvlg(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same network in MILVLG's layout: background moved first in the class rows (and
    the class embedding), a zero-logit background row beside each objectness logit (the
    two-way softmax then equals the sigmoid), zero background box rows, "no attribute"
    first, the attribute head renamed."""
    out = dict(state)
    rpn = "proposal_generator.rpn_head.objectness_logits."
    for part in ("weight", "bias"):
        fg = state[rpn + part]
        pair = np.stack([np.zeros_like(fg), fg], axis=1)  # (12, 2, ...)
        out[rpn + part] = pair.reshape(24, *fg.shape[1:])
    box = "roi_heads.box_predictor."

    def bg_first(a):
        return np.concatenate([a[-1:], a[:-1]])

    for part in ("weight", "bias"):
        out[box + "cls_score." + part] = bg_first(state[box + "cls_score." + part])
        reg = state[box + "bbox_pred." + part]
        out[box + "bbox_pred." + part] = np.concatenate([np.zeros_like(reg[:4]), reg])
    if box + "cls_embedding.weight" in state:
        out[box + "cls_embed.weight"] = bg_first(out.pop(box + "cls_embedding.weight"))
        for part in ("weight", "bias"):
            out[box + "attr_linear1." + part] = out.pop(box + "fc_attr." + part)
            out[box + "attr_linear2." + part] = bg_first(out.pop(box + "attr_score." + part))
    return out


def write_pkl(state: dict[str, np.ndarray], path: Path, numpy1: bool = True) -> Path:
    """As py-bottom-up-attention's files: a protocol-2 pickle of ``{"model": ...,
    "__author__": ...}``; ``numpy1`` writes numpy 1.x's global names, as those files
    (made before numpy 2) hold."""
    data = pickle.dumps({"model": state, "__author__": "test"}, protocol=2)
    if numpy1:
        data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    path.write_bytes(data)
    return path


PHOTOS = sorted((Path(__file__).parent / "fixtures" / "photos").glob("*.jpg"))  # CC BY
CROPS = [(0.0, 0.0, 0.6, 1.0), (0.2, 0.1, 1.0, 0.7), (0.1, 0.3, 0.9, 1.0)]  # fractions


def photo_set(n: int) -> list:
    """``n`` RGB images: the CC BY test photos, then crops of them (:data:`CROPS`, other
    sizes and aspect ratios) up to ``n``. Eight are of seven sizes (two photos are 640 x
    480)."""
    from PIL import Image

    base = [Image.open(p).convert("RGB") for p in PHOTOS]
    out = base[:n]
    while len(out) < n:
        k = len(out) - len(base)
        image = base[k % len(base)]
        left, top, right, bottom = CROPS[k % len(CROPS)]
        w, h = image.size
        out.append(image.crop((int(left * w), int(top * h), int(right * w), int(bottom * h))))
    return out
