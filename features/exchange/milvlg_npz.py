"""MILVLG bottom-up-attention.pytorch feature folders: one ``{image_id}.npz`` per image, as
its extraction script saves them (``np.savez_compressed``): ``x`` (num_bbox, D) region
features, ``bbox`` (num_bbox, 4) boxes in image pixels, ``num_bbox``, ``image_h``,
``image_w`` and ``info``, a dict with ``objects_id`` / ``objects_conf`` (and, for the
attribute model, ``attrs_id`` / ``attrs_conf``), one per region.

``info`` is a pickled object array. It is read with an unpickler that builds numpy arrays
and plain Python values only: a file that asks for anything else is refused, never run.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from features.exchange.butd_tsv import LABELS, MalformedRow, Source, import_regions
from features.ingest.manifest import IngestError, Manifest
from features.store.spec import StoreConfig
from infra.config import one_line

NPZ_ARRAYS = ("x", "bbox", "num_bbox", "image_h", "image_w")


class _ArraysOnly(pickle.Unpickler):
    """Finds what numpy's own pickle of an array needs, and nothing else."""

    def find_class(self, module: str, name: str):
        multiarray = module in ("numpy.core.multiarray", "numpy._core.multiarray")
        if multiarray and name in ("_reconstruct", "scalar"):
            return getattr(np._core.multiarray, name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a numpy array")


def _read_info(path: Path) -> dict:
    """The ``info`` dict of a MILVLG ``.npz``, unpickled with numpy arrays only."""
    with zipfile.ZipFile(path) as archive, archive.open("info.npy") as f:
        version = np.lib.format.read_magic(f)
        read_header = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read_header is None:
            raise MalformedRow(f"{path}: info: .npy format {version} not supported")
        shape, _, dtype = read_header(f)
        if dtype.kind != "O" or shape != ():
            raise MalformedRow(f"{path}: info: {dtype} array of shape {shape}, not a dict")
        try:
            info = _ArraysOnly(f).load()
        except pickle.UnpicklingError as err:
            raise MalformedRow(f"{path}: info refused: {err}") from None
    info = info.item() if isinstance(info, np.ndarray) and info.shape == () else info
    if not isinstance(info, dict):
        raise MalformedRow(f"{path}: info is a {type(info).__name__}, not a dict")
    return info


def _integer(value, what: str) -> int:
    value = np.asarray(value)
    if value.shape != () or value.dtype.kind not in "iu" or not 0 <= int(value) < 2**31:
        raise MalformedRow(f"{what}: {value.dtype} of shape {value.shape}; expected an integer")
    return int(value)


def read_npz(path: Path) -> dict:
    """One MILVLG ``.npz`` as a row (``features``, ``boxes``, ``image_hw`` and the
    labels ``info`` has), or :class:`MalformedRow` naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
        if head == b"\x93NUMPY":
            raise MalformedRow(f"{path}: a .npy array, not an .npz archive")
        if not head.startswith(b"PK"):  # np.load would try it as a pickle
            raise MalformedRow(f"{path}: not an .npz archive (a zip file): it starts {head!r}")
        with np.load(path, allow_pickle=False) as z:
            absent = [name for name in NPZ_ARRAYS if name not in z.files]
            if absent:
                raise MalformedRow(
                    f"{path}: no {', '.join(absent)}; expected {', '.join(NPZ_ARRAYS)} and "
                    "info, as MILVLG's extraction script saves them"
                )
            arrays = {name: z[name] for name in NPZ_ARRAYS}
            info = _read_info(path) if "info" in z.files else {}
    except MalformedRow:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or damaged archive: one line
        detail = one_line(err, 120)
        raise MalformedRow(
            f"{path}: not a readable .npz ({type(err).__name__}: {detail})"
        ) from None
    n = _integer(arrays["num_bbox"], f"{path}: num_bbox")
    h, w = (_integer(arrays[k], f"{path}: {k}") for k in ("image_h", "image_w"))
    x, bbox = arrays["x"], arrays["bbox"]
    if x.dtype.kind != "f" or x.ndim != 2 or len(x) != n:
        raise MalformedRow(f"{path}: x is {x.dtype} of shape {x.shape}; expected ({n}, dim) floats")
    if bbox.dtype.kind != "f" or bbox.shape != (n, 4):
        raise MalformedRow(f"{path}: bbox is {bbox.dtype} of shape {bbox.shape}; expected ({n}, 4)")
    row = {"features": x, "boxes": bbox, "image_hw": (h, w)}
    for label in LABELS:
        if f"{label}_id" not in info:
            continue
        ids, conf = (np.asarray(info.get(f"{label}_{s}")) for s in ("id", "conf"))
        if (
            ids.dtype.kind not in "iu"
            or ids.shape != (n,)
            or (n and not 0 <= ids.min() <= ids.max() < 2**31)
        ):
            raise MalformedRow(
                f"{path}: info {label}_id is {ids.dtype} of shape {ids.shape}; "
                f"expected {n} class ids"
            )
        if conf.dtype.kind != "f" or conf.shape != (n,):
            raise MalformedRow(
                f"{path}: info {label}_conf is {conf.dtype} of shape {conf.shape}; "
                f"expected {n} floats"
            )
        row[f"{label}_id"], row[f"{label}_conf"] = ids, conf
    return row


def import_npz(
    folder: Path,
    manifest: Manifest,
    store_path: Path,
    cfg: StoreConfig,
    max_regions: int = 36,
    progress: Callable[[Iterable], Iterable] | None = None,
    log: Callable[[str], None] = print,
) -> list[str]:
    """Import a MILVLG folder's ``{image_id}.npz`` files for the manifest's images (ids
    matched to keys as for TSV files); returns the keys with no file. Object and attribute
    ids and confidences are kept when the first readable file has them; a later file
    without them is stored empty and noted."""
    if not folder.is_dir():
        raise IngestError(f"{folder}: not a folder; pass the folder of .npz files")
    files = {p.stem: p for p in sorted(folder.glob("*.npz"))}
    if not files:
        raise IngestError(f"{folder}: no .npz files; is this a MILVLG feature folder?")
    labels: tuple[str, ...] = ()
    for path in files.values():
        try:
            labels = tuple(x for x in LABELS if f"{x}_id" in read_npz(path))
            break
        except MalformedRow:
            continue

    def read_row(image_id: str) -> dict:
        row = read_npz(files[image_id])
        if absent := [x for x in labels if f"{x}_id" not in row]:
            raise MalformedRow(f"{files[image_id]}: info has no {absent[0]}_id; others have")
        return row

    return import_regions(
        {image_id: str(path) for image_id, path in files.items()},
        read_row,
        manifest,
        store_path,
        cfg,
        max_regions,
        source=Source("import-milvlg-npz", folder, [folder.name], "npz", "file"),
        labels=labels,
        expected=", ".join(NPZ_ARRAYS),
        progress=progress,
        log=log,
    )
