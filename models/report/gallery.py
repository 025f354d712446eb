"""What the models retrieve, as data for the retrieval gallery (drawn by
:mod:`models.report.gallery_page` in ``vse report``).

:func:`gallery_data` (run by ``vse evaluate``, which has the model and the split's data
loaded): for a few test queries picked evenly over the split, each direction's top-5 with
the ground truth marked; for multi-view models (MV-VSE, CAMERA: those with
``view_attention``), each view's attention over an image's kept regions and the caption
that view matches best. Plain data, written next to the evaluation metrics.

Region attention follows MV-VSE Fig. 5: for view k, the cosine similarity between each
region's feature and the view's embedding (CAMERA: its summarisation weights over the
regions, eq. 13-14).
"""

from __future__ import annotations

import numpy as np

TOP_K = 5
QUERIES = 3  # per direction
VIEW_IMAGES = 2  # images whose views are drawn, per multi-view model


def query_positions(n: int, count: int) -> list[int]:
    """``count`` positions spread evenly over ``range(n)`` (the same on every run)."""
    return sorted({int(i) for i in np.linspace(0, n - 1, min(count, n))}) if n else []


def image_queries(n_images: int) -> list[int]:
    """The images queried for captions (image-to-text)."""
    return query_positions(n_images, QUERIES)


def caption_query_images(n_images: int) -> list[int]:
    """The images whose first caption is queried for images (text-to-image): others than
    :func:`image_queries` where the split allows."""
    return query_positions(n_images, QUERIES + 1)[1:]


def retrievals(sims, caption_image, image_keys, caption_keys, captions, k: int = TOP_K) -> dict:
    """Top-``k`` of sampled image and caption queries from a similarity matrix ``sims``
    ``(n_img, n_cap)`` whose caption ``c`` belongs to image ``caption_image[c]``."""
    sims = np.asarray(sims, dtype=np.float32)
    caption_image = np.asarray(caption_image)

    def top(scores) -> np.ndarray:
        return np.argsort(-scores, kind="stable")[:k]

    def found(key: str, hit, score, **caption) -> dict:  # one retrieved item
        return {"key": key, **caption, "hit": bool(hit), "score": round(float(score), 4)}

    i2t = [
        {
            "query": image_keys[i],
            "results": [
                found(caption_keys[c], caption_image[c] == i, sims[i, c], caption=captions[c])
                for c in top(sims[i])
            ],
        }
        for i in image_queries(len(image_keys))
    ]
    firsts = [
        int(np.flatnonzero(caption_image == i)[0]) for i in caption_query_images(len(image_keys))
    ]
    t2i = [
        {
            "query": caption_keys[c],
            "caption": captions[c],
            "results": [
                found(image_keys[j], j == caption_image[c], sims[j, c]) for j in top(sims[:, c])
            ],
        }
        for c in firsts
    ]
    return {"image_to_text": i2t, "text_to_image": t2i}


def gallery_data(model, data, img, txt, device) -> dict:
    """The gallery data of one model on one split (``data``, a ``PairData``): the sampled
    queries' top-5 both ways from the split's embeddings ``img`` and ``txt`` (only the
    queries' rows and columns of the similarity matrix are computed) and, for multi-view
    models, the views of a few images over their regions."""
    import torch

    from models.data.arrays import image_arrays, to_device

    queried = image_queries(data.n_images)
    captions = np.searchsorted(data.caption_image, caption_query_images(data.n_images))
    with torch.no_grad():
        rows = model.similarity(img[queried], txt).float().cpu().numpy()  # (Q, C)
        cols = model.similarity(img, txt[captions]).float().cpu().numpy()  # (I, Q)
    sims = np.full((data.n_images, len(data)), -np.inf, dtype=np.float32)
    sims[queried] = rows
    sims[:, captions] = cols
    out = {
        "split": data.split,
        **retrievals(sims, data.caption_image, data.image_keys, data.caption_keys, data.captions),
    }
    regions = data.stores.get("regions")
    if hasattr(model, "view_attention") and regions is not None and "boxes" in regions.fields:
        chosen = query_positions(data.n_images, VIEW_IMAGES)
        batch = to_device(data.image_batch(np.asarray(chosen)), device)
        rows = {"regions": data.image_rows["regions"][chosen]}
        boxes = image_arrays({"regions", "boxes"}, data.stores, rows)["boxes"]  # (B, R, 4)
        entries = view_regions(model, batch, txt, data.captions, data.caption_keys, boxes)
        out["views"] = [
            {"image": data.image_keys[i], **e} for i, e in zip(chosen, entries, strict=True)
        ]
    return out


def view_regions(model, batch: dict, txt, captions, caption_keys, boxes) -> list[dict]:
    """For each image of ``batch``: its kept regions' ``boxes`` (``(B, R, 4)``, normalised),
    each view's attention over them (``model.view_attention``), and the caption (of ``txt``,
    all the split's caption embeddings) that the view matches best."""
    import torch

    with torch.no_grad():
        attention = model.view_attention(batch).float().cpu().numpy()  # (B, V, R)
        views = model.encode_image(batch).float()  # (B, V, D)
        scores = torch.einsum("bvd,cd->bvc", views, txt.to(views)).cpu().numpy()  # (B, V, C)
    lengths = batch["region_lengths"].cpu().numpy()
    boxes = np.asarray(boxes, dtype=np.float32)
    out = []
    for b in range(len(lengths)):
        n = int(lengths[b])
        best = scores[b].argmax(axis=1)
        out.append(
            {
                "boxes": np.round(boxes[b, :n], 4).tolist(),
                "attention": np.round(attention[b, :, :n], 4).tolist(),
                "best_caption": [
                    {
                        "key": caption_keys[c],
                        "caption": captions[c],
                        "score": round(float(scores[b, v, c]), 4),
                    }
                    for v, c in enumerate(best)
                ],
            }
        )
    return out
