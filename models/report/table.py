"""The comparison of all models on one split: a markdown table beside the numbers the
papers report (their datasets, not ours: for orientation only) and a bar plot of rsum."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from models.report.gallery_page import new_figure, write_gallery

# (dataset and protocol, i2t R@1/5/10, t2i R@1/5/10) as printed in the papers
PAPER_NUMBERS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vsepp": ("MS-COCO 1K, fixed CNN (UniVSE Table 1)", (57.7, 86.0, 94.0, 42.8, 77.2, 87.4)),
    "mvvse": ("MS-COCO 5K, BiGRU (MV-VSE Table 2)", (56.7, 84.1, 91.4, 40.3, 70.6, 81.6)),
    "camera": ("MS-COCO 1K, single model (CAMERA Table 3)", (75.9, 95.5, 98.6, 62.3, 90.1, 95.2)),
    "huse": ("UPMC Food-101: accuracy image 73.8, text 87.3, fused 92.3 (HUSE Table 3)", ()),
    "univse": ("MS-COCO 1K (UniVSE Table 1)", (64.3, 89.2, 94.8, 48.3, 81.7, 91.2)),
}
COLUMNS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")


def chance_rsum(result: dict) -> float:
    """Expected rsum of random scores: i2t R@K = 1 - C(n-p, K) / C(n, K) with p captions
    per image among n, t2i R@K = K / images (each 1 when K reaches the candidates)."""
    n, images = result["captions"], result["images"]
    p = round(n / images)
    i2t = sum(1 - math.comb(n - p, min(k, n)) / math.comb(n, min(k, n)) for k in (1, 5, 10))
    t2i = sum(min(k / images, 1.0) for k in (1, 5, 10))
    return 100 * (i2t + t2i)


def _fmt(values) -> str:
    return " | ".join(f"{v:.1f}" for v in values)


def folds_note(result: dict) -> list[str]:
    """What the folds column holds: the protocol, the images it left out and its chance
    level (a fold of 20 images has chance rsum ~160: never read a fold rsum without it)."""
    folds = result.get("folds")
    if not folds:
        return []
    size, n = folds["fold_size"], folds["n_folds"]
    name = "the COCO 1K protocol" if size == 1000 else "NOT the COCO 1K protocol (1000)"
    chance = chance_rsum({"images": size, "captions": round(folds["captions"] / n)})
    left = folds.get("left_out", result["images"] - n * size)
    return [
        f"Folds rsum: mean over {n} folds of {size} images ({name}); {left} images of the "
        f"split left out of the folds; chance level per fold: rsum {chance:.1f}."
    ]


def is_ablation(name: str, result: dict) -> bool:
    """Whether row ``name`` is a run of ``models.ablations`` (named apart from its model)."""
    return result.get("model", name) != name


def markdown_table(results: dict[str, dict]) -> str:
    """One row per model: clean retrieval, rsum, COCO-1K-style folds when present,
    adversarial image-to-text R@1 per attack, classification when reported."""
    if not results:
        return "_no evaluation results_\n"
    first = next(iter(results.values()))
    lines = [
        f"Split `{first['split']}`: {first['images']} images, {first['captions']} captions "
        "(R@K in %, rsum = sum of the six R@K).",
        "",
        "| model | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | folds rsum "
        "| adv. R@1 object | attribute | relation |",
        "|---|" + "---:|" * 11,
    ]
    for name, r in results.items():
        full, folds = r["full"], r.get("folds", {})
        adv = r.get("adversarial", {})
        adv_cells = " | ".join(
            f"{adv[a]['i2t_r1']:.1f}" if a in adv else "-"
            for a in ("object", "attribute", "relation")
        )
        folds_cell = f"{folds['rsum']:.1f}" if folds else "-"
        lines.append(
            f"| {name} | {_fmt(full[c] for c in COLUMNS)} | {full['rsum']:.1f} | {folds_cell} "
            f"| {adv_cells} |"
        )
    lines += [
        "",
        f"Chance level (random scores): rsum {chance_rsum(first):.1f} on the whole split.",
    ]
    runs = {n: r for n, r in results.items() if is_ablation(n, r)}
    if runs:
        lines += [
            "",
            "Ablations (`models.ablations`): "
            + "; ".join(
                f"{n} is {r['model']} on {r.get('image_store', 'another image store')}"
                for n, r in runs.items()
            )
            + ".",
        ]
    lines += folds_note(first)
    classified = {n: r["classification"] for n, r in results.items() if "classification" in r}
    if classified:
        lines += [
            "",
            "| model | accuracy image | text | fused | image weight | fused, equal weights "
            "| class-level R@1 i2t | t2i | i2i | t2t |",
            "|---|" + "---:|" * 9,
        ]
        for name, c in classified.items():
            weight = c.get("fusion_weight_image")
            equal = c.get("accuracy_fused_equal")
            cells = [
                _fmt([c["accuracy_image"], c["accuracy_text"], c["accuracy_fused"]]),
                "-" if weight is None else f"{weight:.2f}",
                "-" if equal is None else _fmt([equal]),
                _fmt(
                    c[f"class_{d}_r1"]
                    for d in ("image_to_text", "text_to_image", "image_to_image", "text_to_text")
                ),
            ]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        lines += [
            "",
            "Fused: the image and text softmaxes averaged with the image weight chosen on the "
            "val split (HUSE Sec. 4.5 gives none); beside it with equal weights.",
        ]
    lines += [
        "",
        "Reported in the papers (their data and features; for orientation only):",
        "",
        "| model | setting | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 |",
        "|---|---|" + "---:|" * 6,
    ]
    for name in dict.fromkeys(r.get("model", n) for n, r in results.items()):
        if name in PAPER_NUMBERS:
            setting, values = PAPER_NUMBERS[name]
            cells = _fmt(values) if values else " | ".join("-" * 6)
            lines.append(f"| {name} | {setting} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_rsum(results: dict[str, dict], path: Path) -> None:
    """Bar plot: clean rsum and the adversarial i2t R@1 sum per model."""
    names = list(results)
    plt, fig = new_figure(10, 3.6)
    axes = fig.subplots(1, 2)
    # an ablation's bar (a run of models.ablations) paler than the models'
    colours = ["#a6bddb" if is_ablation(n, results[n]) else "#4c72b0" for n in names]
    axes[0].bar(names, [results[n]["full"]["rsum"] for n in names], color=colours)
    axes[0].set_ylabel("rsum (max 600)")
    axes[0].set_title(f"retrieval, {next(iter(results.values()))['split']} split")
    attacks = ("object", "attribute", "relation")
    width = 0.8 / (len(attacks) + 1)
    for j, series in enumerate(("clean", *attacks)):
        values = [
            results[n]["full"]["i2t_r1"]
            if series == "clean"
            else results[n].get("adversarial", {}).get(series, {}).get("i2t_r1", 0.0)
            for n in names
        ]
        axes[1].bar([i + j * width for i in range(len(names))], values, width, label=series)
    axes[1].set_xticks([i + 1.5 * width for i in range(len(names))], names)
    axes[1].set_ylabel("image-to-text R@1 (%)")
    axes[1].set_title("with adversarial captions")
    axes[1].legend(fontsize=8)
    for ax in axes:  # run names are longer than model names: slanted, they never overlap
        plt.setp(ax.get_xticklabels(), rotation=25, ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_training(histories: dict[str, list[dict]], path: Path) -> None:
    """Training curves of every model in one figure: the loss (each model's own scale, so
    divided by its first epoch's) and the validation rsum, per epoch."""
    plt, fig = new_figure(10, 3.6)
    loss_ax, rsum_ax = fig.subplots(1, 2)
    for name, rows in histories.items():
        epochs = [r["epoch"] + 1 for r in rows]
        first = rows[0]["loss"] or 1.0
        loss_ax.plot(epochs, [r["loss"] / first for r in rows], marker=".", label=name)
        rsum_ax.plot(epochs, [r.get("val_rsum", math.nan) for r in rows], marker=".", label=name)
    loss_ax.set(xlabel="epoch", ylabel="training loss / first epoch's", title="training loss")
    rsum_ax.set(xlabel="epoch", ylabel="rsum (max 600)", title="validation rsum")
    rsum_ax.legend(fontsize=8)
    for ax in (loss_ax, rsum_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def write_report(
    results: list[Path],
    out: Path,
    plot: Path,
    histories: list[Path] | None = None,
    curves: Path | None = None,
) -> str:
    """Stage ``report``: the markdown comparison of every model's evaluation, the bar plot
    and (with ``histories``, the per-epoch rows of ``vse train --plots``) the training
    curves of all models in one PNG; returns the table."""
    from infra.config import UserError
    from infra.files import atomic_path, write_text

    by_model = {}
    for path in results:
        if not path.exists():
            raise UserError(f"{path}: no evaluation results; run `vse evaluate` first")
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(result, dict):
                raise ValueError("not a JSON object")
            for key in ("model", "split", "images", "captions", "full"):
                if key not in result:
                    raise ValueError(f"no {key!r}")
        except (ValueError, UnicodeDecodeError) as err:
            raise UserError(
                f"{path}: not the results of `vse evaluate` ({err}); rerun it (dvc repro)"
            ) from None
        by_model[result.get("name", result["model"])] = result
    splits = {r["split"] for r in by_model.values()}
    if len(splits) > 1:
        raise UserError(f"results come from different splits ({sorted(splits)}): not comparable")
    table = markdown_table(by_model)
    images = f"\n![rsum per model]({os.path.relpath(plot, out.parent)})\n"
    with atomic_path(plot) as tmp:
        plot_rsum(by_model, tmp)
    if histories and curves:
        rows = {}
        for path in histories:
            if not path.exists():
                raise UserError(f"{path}: no training history; run `vse train` first")
            rows[path.stem] = json.loads(path.read_text())
        with atomic_path(curves) as tmp:
            plot_training(rows, tmp)
        images += f"\n![training curves]({os.path.relpath(curves, out.parent)})\n"
    write_text(out, "# Model comparison\n\n" + table + images)
    return table


def write_galleries(
    galleries: list[Path],
    manifest: Path,
    images: Path,
    extremes: Path | None,
    html: Path,
    pngs: Path,
) -> list[Path]:
    """Every model's retrieval gallery (:func:`models.report.gallery_page.write_gallery`)
    with the manifest's images and, if given, the test split's Sentence-BERT extremes."""
    from features.ingest.manifest import read_manifest

    table = read_manifest(manifest).table
    image_paths = {
        key: images / path
        for key, path in zip(table["key"].to_pylist(), table["path"].to_pylist(), strict=True)
    }
    consistency = None
    if extremes is not None:
        every = json.loads(extremes.read_text())
        consistency = {split: every[split] for split in ("test",) if split in every}
    loaded = [json.loads(path.read_text()) for path in galleries]
    return write_gallery({g["model"]: g for g in loaded}, image_paths, consistency, html, pngs)
