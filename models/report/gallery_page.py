"""The retrieval gallery of ``vse report``, drawn from the data :mod:`models.report.gallery`
gives: every model's gallery data, the images and the Sentence-BERT extremes drawn as PNGs,
and one self-contained HTML page that inlines them (no network, no files beside it
needed). Region attention (MV-VSE Fig. 5) is drawn as each kept region's box, filled in
proportion to the view's attention.
"""

from __future__ import annotations

import base64
import html
import io
import textwrap
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------- drawing


def new_figure(width: float, height: float):
    """pyplot (on the Agg backend: no display) and a new figure of that size in inches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(width, height))


def _png(plt, fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def _show(ax, image, hit: bool | None = None) -> None:
    ax.imshow(image)
    ax.set_xticks([])
    ax.set_yticks([])
    if hit is not None:
        for spine in ax.spines.values():
            spine.set_edgecolor("#1a9850" if hit else "#bbbbbb")
            spine.set_linewidth(4 if hit else 1)


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def draw_text_to_image(query: dict, per_model: dict[str, dict], load_image) -> bytes:
    """One caption query: each model's top-5 images, the ground truth framed in green."""
    top_k = max(len(results) for results in per_model.values())
    plt, fig = new_figure(2.0 * top_k + 1.6, 1.9 * len(per_model) + 0.7)
    fig.suptitle(f"\u201c{query['caption']}\u201d", fontsize=11)
    rows = len(per_model)
    for r, (model, results) in enumerate(per_model.items()):
        for c, item in enumerate(results):
            ax = fig.add_subplot(rows, top_k, r * top_k + c + 1)
            _show(ax, load_image(item["key"]), item["hit"])
            if c == 0:
                ax.set_ylabel(model, fontsize=10)
            ax.set_title(f"{c + 1}. {item['score']:.2f}", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _png(plt, fig)


def draw_image_to_text(query_key: str, per_model: dict[str, list[dict]], load_image) -> bytes:
    """One image query: each model's top-5 captions, the ground truth ticked in green."""
    lines = sum(len(results) + 1 for results in per_model.values())
    plt, fig = new_figure(11, max(2.6, 0.22 * lines + 0.4))
    ax = fig.add_axes((0.01, 0.05, 0.24, 0.9))
    _show(ax, load_image(query_key))
    ax.set_title(query_key, fontsize=9)
    text = fig.add_axes((0.27, 0.0, 0.72, 1.0))
    text.axis("off")
    y, step = 0.98, 0.96 / max(lines, 1)
    for model, results in per_model.items():
        text.text(0, y, model, fontsize=9, fontweight="bold", va="top")
        y -= step
        for i, item in enumerate(results):
            mark, colour = ("\u2713", "#1a9850") if item["hit"] else ("\u00b7", "#555555")
            line = f"{mark} {i + 1}. {item['caption']}  ({item['score']:.2f})"
            text.text(0.02, y, line, fontsize=8, color=colour, va="top")
            y -= step
    return _png(plt, fig)


def draw_views(model: str, image_key: str, entry: dict, load_image) -> bytes:
    """One image's views (MV-VSE Fig. 5): per view, the kept regions' boxes filled by the
    view's attention, titled with the caption the view matches best."""
    from matplotlib.patches import Rectangle

    image = load_image(image_key)
    h, w = image.shape[:2]
    views = len(entry["attention"])
    cols = min(views, 4)
    rows = -(-views // cols)
    plt, fig = new_figure(3.0 * cols, 3.1 * rows + 0.5)
    fig.suptitle(f"{model}: {image_key}, attention of each view over the regions", fontsize=10)
    for v, weights in enumerate(entry["attention"]):
        ax = fig.add_subplot(rows, cols, v + 1)
        _show(ax, image)
        weights = np.asarray(weights, dtype=np.float64)
        span = weights.max() - weights.min() if len(weights) else 0.0
        strength = (weights - weights.min()) / span if span > 0 else np.ones_like(weights)
        for (x1, y1, x2, y2), s in zip(entry["boxes"], strength, strict=True):
            ax.add_patch(
                Rectangle(
                    (x1 * w, y1 * h),
                    (x2 - x1) * w,
                    (y2 - y1) * h,
                    facecolor=(1.0, 0.55, 0.0, 0.55 * s),
                    edgecolor=(1.0, 0.3, 0.0, 0.3 + 0.7 * s),
                    linewidth=0.5 + 2 * s,
                )
            )
        best = entry["best_caption"][v]
        ax.set_title(f"view {v + 1}: {_wrap(best['caption'], 34)}", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _png(plt, fig)


def draw_consistency(split: str, extremes: dict, load_image) -> bytes:
    """Sentence-BERT's most and least consistent images of a split with their captions."""
    groups = [
        ("most consistent", extremes["most_consistent"][:3]),
        ("least consistent", extremes["least_consistent"][:3]),
    ]
    plt, fig = new_figure(12, 7)
    fig.suptitle(
        f"{split}: captions of one image, most and least alike (Sentence-BERT)", fontsize=11
    )
    for g, (label, items) in enumerate(groups):
        for i, item in enumerate(items):
            ax = fig.add_axes((0.01 + 0.33 * i, 0.5 - 0.47 * g + 0.2, 0.12, 0.22))
            _show(ax, load_image(item["key"]))
            ax.set_title(f"{label}\n{item['key']}: {item['mean_similarity']:.2f}", fontsize=8)
            text = fig.add_axes((0.135 + 0.33 * i, 0.5 - 0.47 * g + 0.02, 0.19, 0.42))
            text.axis("off")
            lines = "\n".join(_wrap(c, 36) for c in item["captions"])
            text.text(0, 1, lines, fontsize=7, va="top", linespacing=1.3)
    return _png(plt, fig)


# --------------------------------------------------------------------------- page


def write_gallery(
    galleries: dict[str, dict],
    image_paths: dict[str, Path],
    extremes: dict | None,
    html_out: Path,
    png_dir: Path,
) -> list[Path]:
    """Draw every figure as a PNG in ``png_dir`` and the page ``html_out`` inlining them
    (base64), with the text of each figure's queries for search and screen readers.
    ``galleries``: model -> :func:`retrievals` (+ ``views`` for multi-view models);
    ``image_paths``: image key -> file. Returns the PNGs written."""
    from PIL import Image

    from infra.files import atomic_path, write_text

    cache: dict[str, np.ndarray] = {}

    def load_image(key: str) -> np.ndarray:
        if key not in cache:
            with Image.open(image_paths[key]) as image:
                cache[key] = np.asarray(image.convert("RGB"))
        return cache[key]

    figures: list[tuple[str, str, str, bytes]] = []  # (section, name, alt text, png)
    models = list(galleries)
    first = galleries[models[0]]
    for q, query in enumerate(first["text_to_image"]):
        per_model = {m: galleries[m]["text_to_image"][q]["results"] for m in models}
        png = draw_text_to_image(query, per_model, load_image)
        figures.append(("Text to image", f"t2i_{q}", query["caption"], png))
    for q, query in enumerate(first["image_to_text"]):
        per_model = {m: galleries[m]["image_to_text"][q]["results"] for m in models}
        png = draw_image_to_text(query["query"], per_model, load_image)
        figures.append(("Image to text", f"i2t_{q}", query["query"], png))
    for model, gallery in galleries.items():
        for i, entry in enumerate(gallery.get("views", [])):
            alt = "; ".join(b["caption"] for b in entry["best_caption"])
            png = draw_views(model, entry["image"], entry, load_image)
            figures.append(("Views over regions (MV-VSE Fig. 5)", f"views_{model}_{i}", alt, png))
    for split, groups in (extremes or {}).items():
        png = draw_consistency(split, groups, load_image)
        figures.append(("Caption consistency (MV-VSE Fig. 2)", f"sbert_{split}", split, png))

    written = []
    with atomic_path(png_dir, directory=True) as tmp:
        for _, name, _, png in figures:
            (tmp / f"{name}.png").write_bytes(png)
            written.append(png_dir / f"{name}.png")
    sections: dict[str, list[str]] = {}
    for section, name, alt, png in figures:
        data = base64.b64encode(png).decode()
        sections.setdefault(section, []).append(
            f'<figure id="{name}"><img alt="{html.escape(alt)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(alt)}'
            "</figcaption></figure>"
        )
    body = "\n".join(
        f"<h2>{html.escape(title)}</h2>\n" + "\n".join(items) for title, items in sections.items()
    )
    page = GALLERY_PAGE.format(models=html.escape(", ".join(models)), body=body)
    write_text(html_out, page)
    return written


GALLERY_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Retrieval gallery</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
figure {{ margin: 0 0 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-size: 0.8em; color: #666; }}
</style></head>
<body>
<h1>Retrieval gallery</h1>
<p>Models: {models}. Ground truth: green frame (images), green tick (captions). Every image
is inlined in this file: it needs no network and no other file.</p>
{body}
<script>
// for tests and readers: whether every image decoded
window.addEventListener("load", () => {{
  const ok = [...document.images].every((i) => i.complete && i.naturalWidth > 0);
  document.body.dataset.imagesLoaded = String(ok);
}});
</script>
</body></html>
"""
