"""Validation of records: what cannot be used is dropped and reported by key and reason
(``errors.csv``), never a reason to abort a run."""

from __future__ import annotations

import configparser
import csv
import functools
import math
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from features.ingest.manifest import KARPATHY_SPLITS, SPLITS, Dataset, Record

# Reasons that drop a record or a caption (they count towards max_error_fraction) ...
ERRORS = (
    "malformed_record",
    "missing_image",
    "unreadable_path",
    "path_escapes_root",
    "symlink_escapes_root",
    "duplicate_key",
    "unknown_split",
    "empty_caption",
    "non_utf8_text",
    "no_captions",
    "bad_label",
    "bad_boxes",
    "bad_box_names",
    "bad_box_attributes",
)


# ... and reasons that are only reported: the record is kept as it is.
WARNINGS = ("caption_count",)


@dataclass
class Issue:
    key: str
    reason: str
    detail: str


@dataclass
class Report:
    records_read: int = 0
    records_kept: int = 0
    captions_kept: int = 0
    errors: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)

    def error(self, key: str, reason: str, detail: str) -> None:
        self.errors.append(Issue(key, reason, detail))

    @property
    def records_with_errors(self) -> int:
        return len({issue.key for issue in self.errors})

    @property
    def error_fraction(self) -> float:
        return self.records_with_errors / max(self.records_read, 1)

    def counts(self) -> dict[str, int]:
        counts = Counter(issue.reason for issue in self.errors + self.warnings)
        return {reason: counts.get(reason, 0) for reason in ERRORS + WARNINGS}

    def summary(self, splits: dict[str, int]) -> dict:
        """The figures written as DVC metrics and printed at the end of the stage."""
        return {
            "records_read": self.records_read,
            "records_kept": self.records_kept,
            "captions_kept": self.captions_kept,
            "records_with_errors": self.records_with_errors,
            "error_fraction": round(self.error_fraction, 6),
            "splits": splits,
            "counts": self.counts(),
        }


def _dvc_caches(images_root: Path) -> list[Path]:
    """The DVC cache of the repository holding ``images_root`` (``.dvc/cache``, or the
    ``cache.dir`` its config names), where DVC may check images out as symlinks."""
    for folder in [images_root.absolute(), *images_root.absolute().parents]:
        dvc = folder / ".dvc"
        if dvc.is_dir():
            caches = [dvc / "cache"]
            for name in ("config", "config.local"):
                parser = configparser.ConfigParser()
                try:
                    parser.read_string(
                        "\n".join(line.strip() for line in (dvc / name).read_text().splitlines())
                    )
                except (OSError, configparser.Error, UnicodeDecodeError):
                    continue
                if parser.has_option("cache", "dir"):
                    caches.append(dvc / parser.get("cache", "dir"))  # relative to .dvc/
            return caches
    return []


@functools.cache
def _allowed_roots(images_root: Path) -> tuple[Path, ...]:
    """Where an image may resolve to: inside the images root or DVC's cache."""
    return tuple(p.resolve() for p in [images_root, *_dvc_caches(images_root)])


def check_path(
    images_root: Path, path: str, allow_symlinks_outside: bool = False
) -> tuple[str, str | None, str]:
    """Normalise ``path`` and check the file; returns ``(path, reason or None, detail)``.

    The path must stay inside the root lexically (no ``..``, not absolute), and, unless
    ``allow_symlinks_outside``, once symlinks are resolved: inside the images root or the
    repository's DVC cache (DVC in symlink mode checks images out as links into it).
    """
    if not path or "\x00" in path or not is_utf8(path):
        return path, "unreadable_path", "empty path, NUL byte in path or not valid UTF-8"
    normalised = posixpath.normpath(path.replace("\\", "/"))
    if posixpath.isabs(normalised) or normalised == ".." or normalised.startswith("../"):
        return path, "path_escapes_root", f"{path!r} is outside the images root"
    full = images_root / normalised
    try:
        if not full.is_file():
            if full.exists():
                return normalised, "unreadable_path", f"{full} is not a regular file"
            return normalised, "missing_image", f"{full} does not exist"
    except OSError as err:
        return normalised, "unreadable_path", f"{full}: {err.strerror or err}"
    if not os.access(full, os.R_OK):
        return normalised, "unreadable_path", f"{full}: permission denied"
    if not allow_symlinks_outside:
        resolved = full.resolve()
        roots = _allowed_roots(images_root)
        if not any(resolved.is_relative_to(root) for root in roots):
            return (
                normalised,
                "symlink_escapes_root",
                f"{full} resolves to {resolved}, outside the images root {roots[0]} and DVC's "
                "cache; set prepare.allow_symlinks_outside: true if that is intended",
            )
    return normalised, None, ""


INT32_MAX = 2**31 - 1


FLOAT32_MAX = 3.4028234e38


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_label(label, class_names: list[str] | None) -> str | None:
    """What is wrong with an optional class label, or None: an int indexing the classes."""
    if label is None:
        return None
    if not isinstance(label, int) or isinstance(label, bool):
        return f"label {label!r} is {type(label).__name__}, not a class index"
    limit = len(class_names) if class_names is not None else INT32_MAX + 1
    if not 0 <= label < limit:
        return f"label {label} is outside 0..{limit - 1}" + (
            f" ({len(class_names)} class_names)" if class_names is not None else ""
        )
    return None


def check_boxes(boxes) -> str | None:
    """What is wrong with optional boxes, or None: a list of ``[x1, y1, x2, y2]`` finite
    float32 numbers with ``x1 <= x2`` and ``y1 <= y2``."""
    if boxes is None:
        return None
    if not isinstance(boxes, list):
        return f"boxes is {type(boxes).__name__}, not a list of [x1, y1, x2, y2]"
    for i, box in enumerate(boxes):
        if not isinstance(box, list) or len(box) != 4 or not all(map(_is_number, box)):
            return f"box {i} is {str(box)[:60]}, not [x1, y1, x2, y2] numbers"
        if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in box):
            return f"box {i} {box} has a value that is not a finite float32"
        if box[0] > box[2] or box[1] > box[3]:
            return f"box {i} {box} has x1 > x2 or y1 > y2"
    return None


def _is_text(value) -> bool:
    return isinstance(value, str) and is_utf8(value)


PER_BOX = {  # optional per-box fields: the check of one value, and what the field must be
    "box_names": (_is_text, "a list of (UTF-8) strings"),
    "box_attributes": (
        lambda a: isinstance(a, list) and all(map(_is_text, a)),
        "one list of strings per box",
    ),
}


def check_per_box(field: str, values, boxes) -> str | None:
    """What is wrong with the optional per-box ``field`` (box names or attributes), or
    None: a list of one value per box."""
    if values is None:
        return None
    is_value, expected = PER_BOX[field]
    if not isinstance(values, list) or not all(map(is_value, values)):
        return f"{field} is {str(values)[:60]!r}, not {expected}"
    if isinstance(boxes, list) and len(values) == len(boxes):
        return None
    return f"{len(values)} {field} for {len(boxes) if isinstance(boxes, list) else 'no'} boxes"


def check_key(key) -> str | None:
    """What is wrong with an image key, or None: caption keys are ``<key>#<i>``."""
    if not isinstance(key, str) or not key.strip() or not is_utf8(key):
        return "empty image key (file name), or not valid UTF-8"
    if "#" in key or any(c in key for c in "\n\r\t\x00"):
        return f"image key {key!r} holds '#' or a control character (caption keys are key#i)"
    return None


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate(
    dataset: Dataset,
    images_root: Path,
    captions_per_image: int,
    progress: Callable[[Iterable], Iterable] | None = None,
    allow_symlinks_outside: bool = False,
) -> tuple[list[Record], Report]:
    """Keep the good records, drop bad captions and records, and report everything."""
    report = Report(records_read=len(dataset.records))
    kept: list[Record] = []
    seen: dict[str, str] = {}
    records = progress(dataset.records) if progress else dataset.records
    for record in records:
        key = record.key
        problem = record.problem or check_key(key)
        if problem:
            report.error(str(key), "malformed_record", problem)
            continue
        if key in seen:
            report.error(key, "duplicate_key", f"{record.path} has the same key as {seen[key]}")
            continue
        seen[key] = record.path
        record.path, reason, detail = check_path(images_root, record.path, allow_symlinks_outside)
        if reason:
            report.error(key, reason, detail)
        if record.split not in KARPATHY_SPLITS:
            report.error(
                key,
                "unknown_split",
                f"split {record.split!r} is not one of {', '.join(SPLITS)}",
            )
        captions = []
        for i, caption in enumerate(record.captions):
            if not isinstance(caption, str):
                report.error(
                    key,
                    "malformed_record",
                    f"caption {i} is {type(caption).__name__}, not text",
                )
            elif not is_utf8(caption):
                report.error(key, "non_utf8_text", f"caption {i} is not valid UTF-8: {caption!r}")
            elif not caption.strip():
                report.error(key, "empty_caption", f"caption {i} is empty or whitespace")
            else:
                captions.append(caption.strip())
        if not captions:
            report.error(key, "no_captions", "no usable caption left")
        fields = {
            "bad_label": check_label(record.label, dataset.class_names),
            "bad_boxes": check_boxes(record.boxes),
            **{f"bad_{f}": check_per_box(f, getattr(record, f), record.boxes) for f in PER_BOX},
        }
        for field_reason, field_detail in fields.items():
            if field_detail:
                report.error(key, field_reason, field_detail)
        if reason or record.split not in KARPATHY_SPLITS or not captions or any(fields.values()):
            continue  # the record cannot be used (or has a malformed optional field): reported
        if len(captions) != captions_per_image:
            warning = f"{len(captions)} captions, expected {captions_per_image} (kept)"
            report.warnings.append(Issue(key, "caption_count", warning))
        record.captions = captions
        kept.append(record)
    report.records_kept = len(kept)
    report.captions_kept = sum(len(r.captions) for r in kept)
    return kept, report


def write_errors(report: Report, path: Path) -> None:
    """All errors and warnings as CSV rows ``key, severity, reason, detail``."""
    from infra.files import atomic_path

    with (
        atomic_path(path) as tmp,
        open(tmp, "w", encoding="utf-8", errors="backslashreplace", newline="") as f,
    ):
        writer = csv.writer(f)
        writer.writerow(["key", "severity", "reason", "detail"])
        for severity, issues in (("error", report.errors), ("warning", report.warnings)):
            for issue in issues:
                writer.writerow([issue.key, severity, issue.reason, issue.detail])
