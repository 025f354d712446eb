"""What an image stage reports after extraction: its bad images (errors CSV and metrics,
from the notes the store's shards keep) and, for regions, how well they cover the
manifest's ground-truth boxes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from features.ingest.manifest import Manifest
from features.store.reader import Store

NO_REGIONS = "no_regions"  # an error: the image is stored empty (valid = 0)
FEW_REGIONS = "few_regions"  # a warning: the image keeps its regions
WARNINGS = {FEW_REGIONS}


def report_bad_images(
    store_path: Path,
    errors: Path,
    metrics: Path,
    max_error_fraction: float,
    extra: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """The errors CSV and metrics JSON of an image stage, from the notes the store's
    shards keep (so a resumed run reports every bad image); too many fail the stage,
    and then the store is withdrawn from its path (:func:`withdraw_store`: a failed stage
    publishes nothing; a rerun resumes). Warnings (``few_regions``) are reported but do
    not count as bad images. ``extra`` joins the metrics (e.g. :func:`region_recall`).
    The metrics hold counts only: DVC hashes them, so nothing depends on run time."""
    from features.ingest.manifest import IngestError
    from features.ingest.validate import Issue, Report, write_errors
    from features.store.layout import withdraw_store
    from infra.files import write_json

    store = Store.open(store_path)
    n = len(store)
    report = Report(records_read=n, records_kept=n)
    for key, (reason, detail) in sorted(store.notes().items()):
        if reason in WARNINGS:
            report.warnings.append(Issue(key, reason, detail))
        else:
            report.error(key, reason, detail)
    write_errors(report, errors)
    counts = dict(Counter(issue.reason for issue in report.errors + report.warnings))
    summary = {
        "images": n,
        "bad_images": len(report.errors),
        "error_fraction": round(report.error_fraction, 6),
        "counts": counts,
        **(extra or {}),
    }
    write_json(metrics, summary)
    listing = ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"
    log(f"extract: bad images: {listing} (report: {errors})")
    if report.error_fraction > max_error_fraction:
        withdraw_store(store_path)
        raise IngestError(
            f"{len(report.errors)} of {n} images ({report.error_fraction:.2%}) could not be "
            f"used, more than max_error_fraction = {max_error_fraction:.2%}; see {errors} "
            f"({store_path} withdrawn: a rerun resumes it)"
        )
    return summary


def region_recall(store_path: Path, manifest: Manifest, iou: float = 0.5) -> dict | None:
    """How well a regions store covers the manifest's ground-truth boxes, or ``None`` when
    the manifest has none: per split and overall, the share of ground-truth boxes that a
    kept region overlaps with IoU >= ``iou`` (``gt_recall``) and the mean number of kept
    regions per image (``regions_per_image``), over the images extracted (``valid``)."""
    from torchvision.ops import box_iou

    truth = manifest.table["boxes"].to_pylist()
    if not any(truth):
        return None
    store = Store.open(store_path, kind="regions", manifest_digest=manifest.digest)
    data = store.read(0, len(store), ["boxes", "n_regions", "valid"])
    splits = manifest.table["split"].to_pylist()
    counts: dict[str, list[int]] = {}  # split -> [images, regions, gt boxes, gt found]
    for i, gt in enumerate(truth):
        if not data["valid"][i]:
            continue
        n = int(data["n_regions"][i])
        found = 0
        if gt and n:
            overlaps = box_iou(torch.tensor(gt), torch.from_numpy(data["boxes"][i, :n]))
            found = int((overlaps.max(dim=1).values >= iou).sum())
        for key in (splits[i], "all"):
            c = counts.setdefault(key, [0, 0, 0, 0])
            for j, add in enumerate((1, n, len(gt or []), found)):
                c[j] += add
    return {
        split: {
            "images": c[0],
            "regions_per_image": round(c[1] / max(c[0], 1), 4),
            "gt_boxes": c[2],
            "gt_recall": round(c[3] / max(c[2], 1), 4),
        }
        for split, c in sorted(counts.items())
    }
