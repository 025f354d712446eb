"""Image feature extraction: reader -> mapper -> writer.

- reader: DataLoader workers decode each image (:func:`features.decode.load_image`) and
  run the extractor's ``prepare`` (resize, normalise), overlapped with inference;
- mapper: the extractor's ``forward``, batched, on the device; its ``finish`` (copy to the
  host, region selection, packing) runs on a background thread while the next batch's
  forward runs, so the device does not wait for the host;
- writer: the feature store, one shard at a time, on another background thread; a bad
  image, or one whose features hold NaN or infinite values (as stored: float16 overflows
  count), gets an empty record (``valid = 0``) and a note in its shard's commit marker, so
  the report survives resumes.

Only pending shards are read: a rerun after a crash continues where the last committed
shard ended. With ``shards=``, only those shards are extracted, by a shard writer: how
several processes (Dask workers, see :mod:`flows.distributed`) fill one store together.
Each phase is timed as what it adds to the wall time: read = waiting for decoded
batches, infer = queueing the forward passes (on the CPU: running them), finish = waiting
for a batch's records, write = waiting for a shard write to finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, Dataset

from features.decode import BadImage, load_image
from features.detector.weights import weights_digest
from features.images.config import ExtractConfig
from features.images.extractor import EXTRACTOR_VERSION, ImageExtractor
from features.images.report import FEW_REGIONS, NO_REGIONS
from features.ingest.manifest import Manifest
from features.store.remote import RemoteStoreWriter
from features.store.spec import FieldSpec, Provenance, StoreConfig
from features.store.writer import ShardWriter, StoreWriter
from infra.device import resolve_device
from infra.files import is_url
from infra.finite import NON_FINITE, nonfinite_fields
from infra.resume import init_worker


class ImageItems(Dataset):
    """Manifest rows -> prepared items, or the reason an image could not be used."""

    def __init__(
        self, rows: list[dict], indices: list[int], images_root: Path, prepare, cfg: ExtractConfig
    ):
        self.rows, self.indices = rows, indices
        self.images_root, self.prepare, self.cfg = images_root, prepare, cfg

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        try:
            path = self.images_root / row["path"]
            image = load_image(path, self.cfg.max_pixels, self.cfg.max_aspect_ratio)
            item = self.prepare(image, row)
            item["error"] = None
        except BadImage as err:
            item = {"error": (err.reason, err.detail)}
        item["index"] = self.indices[i]
        return item


def build_image_extractor(kind: str, cfg: ExtractConfig) -> ImageExtractor:
    """The extractor of image stage ``kind`` ("regions" or "grid") from its params."""
    from features.images.grid import GridExtractor, build_trunk
    from features.images.regions import RegionExtractor, build_detector

    device = resolve_device(cfg.device)
    if kind == "grid":
        return GridExtractor(build_trunk(cfg), cfg, device)
    if cfg.backend == "detectron2":
        from features.images.detectron2_backend import build_detectron2_extractor

        return build_detectron2_extractor(cfg, device)
    from features.images.butd.model import ButdModel

    model = build_detector(cfg)
    if isinstance(model, ButdModel):
        from features.images.butd.extractor import ButdRegionExtractor

        return ButdRegionExtractor(model, cfg, device)
    return RegionExtractor(model, cfg, device)


@dataclass
class Timing:
    read: float = 0.0
    infer: float = 0.0
    finish: float = 0.0
    write: float = 0.0
    images: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.images / max(self.seconds, 1e-9)
        return (
            f"{self.images} images in {self.seconds:.1f} s ({rate:.1f} img/s); read "
            f"{self.read:.1f} s, infer {self.infer:.1f} s, finish {self.finish:.1f} s, "
            f"write {self.write:.1f} s"
        )


def image_store_writer(
    extractor: ImageExtractor,
    manifest: Manifest,
    store_path: Path | str,
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    log: Callable[[str], None] = print,
    shards: Sequence[int] | None = None,
) -> StoreWriter | RemoteStoreWriter:
    """The (unopened) writer of an image store: the extractor's fields plus ``valid``, and
    the provenance that fingerprints it. A coordinator opens it whole to create or
    finalize the store; with ``shards`` it is a shard writer of those shards only. A
    store at an fsspec URL (``s3://...``) gets a :class:`RemoteStoreWriter`."""
    fields = {**extractor.fields(), "valid": FieldSpec((), "uint8")}
    provenance = Provenance(
        extractor.name,
        EXTRACTOR_VERSION,
        extractor.provenance_params(),
        weights_digest(cfg.weights, cfg.seed, f"{extractor.kind}.weights"),
        manifest.digest,
    )
    keys = manifest.table["key"].to_pylist()
    args = (store_path, extractor.kind, fields, keys, provenance, store_cfg)
    if is_url(store_path):
        return RemoteStoreWriter(*args, log=log, shards=shards)
    if shards is None:
        return StoreWriter(*args, log=log)
    return ShardWriter(*args, log=log, shards=shards)


def extract_images(
    extractor: ImageExtractor,
    manifest: Manifest,
    images_root: Path,
    store_path: Path | str,
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    log: Callable[[str], None] = print,
    progress: Callable | None = None,
    shards: Sequence[int] | None = None,
) -> Timing:
    """Fill the store at ``store_path`` with the extractor's features for every manifest
    image (resuming a partial store), or only ``shards`` of a store a coordinator created
    (:func:`image_store_writer`); returns the per-phase timing."""
    # what an extractor's prepare reads of a row: the key, the path and (regions) the given
    # boxes; not the captions, which every loader worker would copy as it touched them
    rows = manifest.table.select(["key", "path", "boxes"]).to_pylist()
    timing = Timing()
    start_all = time.perf_counter()
    writer = image_store_writer(extractor, manifest, store_path, cfg, store_cfg, log, shards)
    dtypes = {name: spec.dtype for name, spec in writer.fields.items()}
    # batch i is finished (selection, packing) on one thread, and its complete shards are
    # written on another, while batch i+1 runs on the device; on an error, no write outlives
    # the writer's lock
    with (
        writer,
        ThreadPoolExecutor(max_workers=1) as writes,
        ThreadPoolExecutor(max_workers=1) as finishing,
    ):
        out = _Shards(writer, rows, timing, writes)
        order = [i for shard in out.pending for i in range(*writer.shard_range(shard))]
        loader = DataLoader(
            ImageItems([rows[i] for i in order], order, images_root, extractor.prepare, cfg),
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            collate_fn=list,  # images differ in size: the model batches them
            pin_memory=extractor.device.type == "cuda",
            worker_init_fn=init_worker,
        )
        bar = progress(total=len(order)) if progress else None
        batches = iter(loader)
        previous = None
        while True:
            tick = time.perf_counter()
            batch = next(batches, None)
            timing.read += time.perf_counter() - tick
            current = None
            if batch is not None:
                good = [item for item in batch if item["error"] is None]
                tick = time.perf_counter()
                raw = extractor.forward(good) if good else None
                timing.infer += time.perf_counter() - tick
                current = batch, finishing.submit(extractor.finish, good, raw) if good else None
            if previous is not None:
                done, records = previous
                tick = time.perf_counter()
                results = records.result() if records is not None else []
                timing.finish += time.perf_counter() - tick
                out.add(_stored(extractor, done, results, dtypes))
                timing.images += len(done)
                if bar is not None:
                    bar.update(len(done))
            if current is None:
                break
            previous = current
        if bar is not None:
            bar.close()
        out.wait()  # the last write (its error raised)
    timing.seconds = time.perf_counter() - start_all
    return timing


def _stored(extractor, batch: list[dict], results: list[dict], dtypes: dict):
    """(manifest index, store record, note) of each item of a finished batch, ``results``
    being those of its readable items in order. An image that could not be read, whose
    features hold NaN or infinite values (as stored) or that has no regions is stored empty
    (``valid = 0``) with the reason as its note; one short of ``regions.min_boxes`` is
    stored with a note. The selection keeps up to ``min_boxes`` proposals whatever their
    score (as ``generate_tsv.py``), so an image is short only when the detector proposed
    fewer boxes; given boxes (``regions.backend: given``) are never short."""
    min_boxes = getattr(getattr(extractor, "cfg", None), "min_boxes", 0)
    if getattr(extractor, "given", False):
        min_boxes = 0
    results = iter(results)
    for item in batch:
        error, note = item["error"], None
        if error is None:
            result = next(results)
            n = int(result.get("n_regions", min_boxes))
            if bad := nonfinite_fields(result, dtypes):
                error = (NON_FINITE, f"{', '.join(bad)}: NaN or infinite values")
            elif n < min_boxes:
                detail = f"{n} regions < min_boxes {min_boxes}: the detector proposed {n} boxes"
                if n == 0:  # nothing to train on: stored empty
                    error = (NO_REGIONS, detail)
                else:
                    note = (FEW_REGIONS, detail)
        if error is not None:
            yield item["index"], {**extractor.empty(), "valid": np.uint8(0)}, list(error)
        else:
            yield item["index"], {**result, "valid": np.uint8(1)}, note and list(note)


class _Shards:
    """Records gathered into the writer's pending shards; each complete shard is written,
    in order, by a background thread while the next batches run. Waiting for the previous
    write is what writing adds to the wall time (``timing.write``)."""

    def __init__(self, writer: StoreWriter | RemoteStoreWriter, rows: list[dict], timing, writes):
        self.writer, self.rows, self.timing, self.writes = writer, rows, timing, writes
        self.pending = writer.pending_shards()
        self.records: dict[int, dict] = {}
        self.notes: dict[str, list[str]] = {}
        self.last: Future | None = None

    def add(self, stored: Iterable[tuple[int, dict, list[str] | None]]) -> None:
        """A finished batch's (manifest index, record, note) triples; then the shards they
        complete are written."""
        for index, record, note in stored:
            self.records[index] = record
            if note:
                self.notes[self.rows[index]["key"]] = note
        while self.pending and all(
            i in self.records for i in range(*self.writer.shard_range(self.pending[0]))
        ):
            shard = self.pending.pop(0)
            lo, hi = self.writer.shard_range(shard)
            records = [self.records.pop(i) for i in range(lo, hi)]
            data = {name: np.stack([r[name] for r in records]) for name in self.writer.fields}
            keys = [self.rows[i]["key"] for i in range(lo, hi)]
            notes = {k: self.notes.pop(k) for k in keys if k in self.notes}
            self.wait()
            self.last = self.writes.submit(self.writer.write_shard, shard, data, notes)

    def wait(self) -> None:
        """Wait for the previous shard write (re-raising its error)."""
        if self.last is not None:
            tick = time.perf_counter()
            self.last.result()
            self.timing.write += time.perf_counter() - tick
