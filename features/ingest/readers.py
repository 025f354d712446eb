"""Readers of raw datasets (Karpathy JSON for Flickr30K and COCO, UPMC Food-101 CSVs, the
demo): each turns annotations into records, before validation."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field

from features.ingest.manifest import SPLITS, Dataset, IngestError, Record
from features.ingest.validate import is_utf8
from infra.config import Section, Seed


class PrepareConfig(Section):
    """``prepare`` section of params.yaml."""

    format: Literal["demo", "karpathy", "flickr8k", "food101"] = "demo"
    captions_per_image: int = Field(5, ge=1)
    restval: Literal["train", "keep"] = "train"
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    seed: Seed = 0
    max_error_fraction: float = Field(0.01, ge=0.0, le=1.0)
    # image paths that resolve (through symlinks) outside the images root and DVC's cache
    allow_symlinks_outside: bool = False


def _read_text(path: Path) -> str:
    """Read a text file as UTF-8; undecodable bytes survive as surrogates to be reported."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            return f.read()  # decoded a buffer at a time: the bytes are never held whole
    except OSError as err:
        raise IngestError(f"{path}: cannot read annotations ({err.strerror or err})") from err


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def _scan_object(text: str, streamed: str, each: Callable[[object], None]) -> dict | None:
    """The members of the JSON object that ``text`` holds, except ``streamed``: the items
    of that member's list are decoded one at a time and handed to ``each``, never held
    together (a whole parsed ``dataset_coco.json`` takes about five times its size; the
    text itself, once). None when the top level is not an object or ``streamed`` is not a
    list in it. Malformed JSON raises :class:`json.JSONDecodeError`, as ``json.loads``."""
    decode = json.JSONDecoder().raw_decode

    def expect(pos: int, *chars: str) -> int:
        """The position after one of ``chars`` at ``pos`` (after whitespace)."""
        pos = _SPACE.match(text, pos).end()
        if text[pos : pos + 1] not in chars:
            raise json.JSONDecodeError(f"Expecting {' or '.join(map(repr, chars))}", text, pos)
        return pos + 1

    pos = _SPACE.match(text).end()
    if not text.startswith("{", pos):
        decode(text, pos)  # malformed, or a value that is not an object
        return None
    members, found = {}, False
    pos = _SPACE.match(text, pos + 1).end()
    if text.startswith("}", pos):
        pos += 1
    while text[pos - 1] != "}":
        key, pos = decode(text, expect(pos, '"') - 1)
        pos = _SPACE.match(text, expect(pos, ":")).end()
        if key == streamed and text.startswith("[", pos):
            found, pos = True, _SPACE.match(text, pos + 1).end()
            if text.startswith("]", pos):
                pos += 1
            while text[pos - 1] != "]":
                item, pos = decode(text, _SPACE.match(text, pos).end())
                each(item)
                pos = expect(pos, ",", "]")
        else:
            members[key], pos = decode(text, pos)
        pos = expect(pos, ",", "}")
    if _SPACE.match(text, pos).end() != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    return members if found else None


def read_karpathy(
    annotations: Path, images_root: Path, cfg: PrepareConfig, demo: bool = False
) -> Dataset:
    """Karpathy split JSON, plus the optional ``label``/``boxes``/``box_names``/
    ``box_attributes`` of datasets with boxes; the demo's (``demo``) box attributes are
    each of its ``objects``' colour and size. The images are read one at a time
    (:func:`_scan_object`), so the memory is the text and the records."""
    records: list[Record] = []

    def add(image: object) -> None:
        records.append(_karpathy_record(len(records), image, cfg, demo))

    try:
        data = _scan_object(_read_text(annotations), "images", add)
    except json.JSONDecodeError as err:
        raise IngestError(f"{annotations}: not valid JSON ({err})") from err
    if data is None:
        raise IngestError(
            f"{annotations}: no top-level 'images' list; expected the Karpathy split JSON "
            "layout of dataset_flickr30k.json / dataset_coco.json"
        )
    class_names = data.get("class_names")
    if class_names is not None and not (
        isinstance(class_names, list)
        and all(isinstance(c, str) and is_utf8(c) for c in class_names)
    ):
        raise IngestError(
            f"{annotations}: 'class_names' must be a list of strings, got "
            f"{type(class_names).__name__}; fix or remove it"
        )
    name = str(data.get("dataset", "karpathy"))
    return Dataset(name if is_utf8(name) else "karpathy", records, class_names)


def _karpathy_record(i: int, image: object, cfg: PrepareConfig, demo: bool) -> Record:
    """The record of ``images[i]`` of a Karpathy split JSON (see :func:`read_karpathy`)."""
    filename = image.get("filename") if isinstance(image, dict) else None
    if not isinstance(filename, str) or not filename:
        return Record(f"<images[{i}]>", "", "", problem="no 'filename'")
    sentences = image.get("sentences", [])
    if not isinstance(sentences, list) or not all(isinstance(s, dict) for s in sentences):
        return Record(Path(filename).stem, filename, "", problem="bad 'sentences'")
    filepath = image.get("filepath") or ""
    if not isinstance(filepath, str):
        return Record(Path(filename).stem, filename, "", problem="bad 'filepath'")
    split = str(image.get("split", ""))
    if split == "restval" and cfg.restval == "train":
        split = "train"
    attributes = image.get("box_attributes")
    if demo and attributes is None and isinstance(image.get("objects"), list):
        attributes = [
            [o.get("color"), o.get("size")] if isinstance(o, dict) else None
            for o in image["objects"]
        ]
    return Record(
        key=Path(filename).stem,
        path=posixpath.join(filepath, filename),
        split=split,
        captions=[s.get("raw", "") for s in sentences],
        label=image.get("label"),
        boxes=image.get("boxes"),
        box_names=image.get("box_names"),
        box_attributes=attributes,
    )


def held_out(key: str, fraction: float, seed: int) -> bool:
    """Deterministic, order-independent choice of the val part of a train split."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_food101(annotations: Path, images_root: Path, cfg: PrepareConfig) -> Dataset:
    """UPMC Food-101: ``annotations`` is one texts CSV or a folder of ``{split}*.csv``."""
    csv_files = sorted(annotations.glob("*.csv")) if annotations.is_dir() else [annotations]
    if not csv_files:
        raise IngestError(f"{annotations}: no *.csv texts files (expected train_titles.csv ...)")
    rows = []
    for csv_file in csv_files:
        split = next((s for s in SPLITS if csv_file.name.startswith(s)), None)
        if split is None:
            raise IngestError(
                f"{csv_file}: cannot tell its split; name texts files train*.csv, val*.csv "
                "or test*.csv"
            )
        split_dir = (images_root / split).is_dir()
        try:
            rows += _food101_rows(csv_file, split, split_dir, cfg)
        except OSError as err:
            raise IngestError(f"{csv_file}: cannot read ({err.strerror or err})") from None
    class_names = sorted({r.label for r in rows if r.problem is None})
    for r in rows:
        if r.problem is None:
            r.label = class_names.index(r.label)
    return Dataset("food101", rows, class_names)


def _food101_rows(csv_file: Path, split: str, split_dir: bool, cfg: PrepareConfig) -> list:
    """The records of one Food-101 texts CSV (``image name, text, class``)."""
    rows = []
    with open(csv_file, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        try:
            for row in reader:
                line_no = reader.line_num
                if line_no == 1 and row and row[0].strip().lower() in ("image name", "image_name"):
                    continue  # header
                if len(row) < 3:
                    key = f"<{csv_file.name}:{line_no}>"
                    rows.append(Record(key, "", split, problem="expected 3 columns"))
                    continue
                name, text, label = row[0].strip(), row[1], row[2].strip()
                key = Path(name).stem
                if not (is_utf8(name) and is_utf8(label)) or not label:
                    problem = f"line {line_no}: image name or class is empty or not UTF-8"
                    rows.append(Record(f"<{csv_file.name}:{line_no}>", "", split, problem=problem))
                    continue
                path = posixpath.join(split if split_dir else "", label, name)
                held = split == "train" and held_out(key, cfg.val_fraction, cfg.seed)
                rows.append(Record(key, path, "val" if held else split, [text], label=label))
        except csv.Error as err:
            raise IngestError(
                f"{csv_file}:{reader.line_num}: not readable as CSV ({err})"
            ) from None
    return rows


# the original Flickr8k release (Hodosh et al. 2013): captions, and one split list per split
FLICKR8K_TOKENS = "Flickr8k.token.txt"
FLICKR8K_SPLITS = {
    "train": "Flickr_8k.trainImages.txt",
    "val": "Flickr_8k.devImages.txt",
    "test": "Flickr_8k.testImages.txt",
}


def read_flickr8k(annotations: Path, images_root: Path, cfg: PrepareConfig) -> Dataset:
    """The original Flickr8k text release: ``annotations`` is its folder (Flickr8k_text),
    holding ``Flickr8k.token.txt`` (``IMAGE.jpg#N<TAB>caption`` lines) and the split lists
    ``Flickr_8k.{train,dev,test}Images.txt`` (6000/1000/1000 images; ``dev`` is ``val``).
    Images in no split list are not part of the dataset; a listed image without captions
    is a record with a problem."""
    folder = annotations if annotations.is_dir() else annotations.parent
    captions: dict[str, list[tuple[int, str]]] = {}
    tokens = folder / FLICKR8K_TOKENS
    if not tokens.is_file():
        raise IngestError(f"{folder}: no {FLICKR8K_TOKENS}; give the Flickr8k_text folder")
    for n, line in enumerate(_read_text(tokens).splitlines(), 1):
        if not line.strip():
            continue
        ref, sep, text = line.partition("\t")
        name, hash_, index = ref.partition("#")
        if not (sep and hash_ and index.strip().isdigit()):
            raise IngestError(f"{tokens}:{n}: expected IMAGE.jpg#N<TAB>caption, got {line[:60]!r}")
        captions.setdefault(name.strip(), []).append((int(index), text.strip()))
    records = []
    for split, list_name in FLICKR8K_SPLITS.items():
        listed = folder / list_name
        if not listed.is_file():
            raise IngestError(f"{folder}: no {list_name} (the {split} split list)")
        for name in filter(None, map(str.strip, _read_text(listed).splitlines())):
            found = [text for _, text in sorted(captions.get(name, []))]
            problem = None if found else f"no captions in {FLICKR8K_TOKENS}"
            records.append(Record(Path(name).stem, name, split, found, problem=problem))
    return Dataset("flickr8k", records)


READERS: dict[str, Callable[[Path, Path, PrepareConfig], Dataset]] = {
    "karpathy": read_karpathy,
    "flickr8k": read_flickr8k,
    "demo": functools.partial(read_karpathy, demo=True),
    "food101": read_food101,
}
