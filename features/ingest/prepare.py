"""Stage ``prepare``: a raw dataset read, validated and written as the manifest, with the
errors report and counts; fails when too many records were bad."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from features.ingest.manifest import KARPATHY_SPLITS, SPLITS, IngestError, write_manifest
from features.ingest.readers import READERS, PrepareConfig
from features.ingest.validate import validate, write_errors


def prepare(
    annotations: Path,
    images_root: Path,
    cfg: PrepareConfig,
    out: Path,
    errors: Path,
    metrics: Path,
    log: Callable[[str], None] = print,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> dict:
    """Stage ``prepare``: read the raw dataset, validate every record, write the errors
    CSV and the metrics JSON, then the manifest, unless more than ``max_error_fraction``
    of the records have errors (an :class:`IngestError` naming the errors file)."""
    from infra.files import write_json

    if not images_root.is_dir():
        raise IngestError(f"{images_root}: images root is not a directory")
    dataset = READERS[cfg.format](annotations, images_root, cfg)
    records, report = validate(
        dataset,
        images_root,
        cfg.captions_per_image,
        progress=progress,
        allow_symlinks_outside=cfg.allow_symlinks_outside,
    )
    by_split = Counter(r.split for r in records)
    summary = report.summary(
        {s: by_split[s] for s in KARPATHY_SPLITS if s in SPLITS or by_split[s]}
    )
    write_errors(report, errors)
    write_json(metrics, summary)
    counts = ", ".join(f"{k} {v}" for k, v in summary["counts"].items() if v) or "none"
    splits = ", ".join(f"{k} {v}" for k, v in summary["splits"].items())
    log(
        f"prepare: {dataset.name}: read {report.records_read} records, kept "
        f"{report.records_kept} ({splits}) with {report.captions_kept} captions\n"
        f"prepare: problems: {counts}\n"
        f"prepare: report: {errors} (every problem by key), {metrics} (counts)"
    )
    if report.error_fraction > cfg.max_error_fraction:
        raise IngestError(
            f"{report.records_with_errors} of {report.records_read} records "
            f"({report.error_fraction:.2%}) have errors, more than "
            f"prepare.max_error_fraction = {cfg.max_error_fraction:.2%}; see {errors}"
        )
    meta = write_manifest(records, dataset, cfg.captions_per_image, out)
    log(f"prepare: wrote {out} (digest {meta['digest'][:12]})")
    return summary
