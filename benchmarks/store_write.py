"""Feature-store write throughput: the store's writer (shard files laid out by hand) against
the same writer going through Zarr's own API, and both against ``np.save`` of the same
bytes into one ``.npy``, in one run.

Four stores, each committed shard by shard with checksums (what the extract stages do):

- ``demo regions``: the demo's regions store (800 images, (10, 256) float16 features,
  boxes, classes, scores, counts);
- ``demo text``: the demo's text store (4000 captions, ragged (10..19, 384) float16 token
  features and int32 wordpiece ids, a (1536,) float16 document vector, a valid flag);
- ``COCO regions``: ``--n`` images of a COCO-sized regions store ((36, 2048) float16
  features, boxes, counts);
- ``ragged tokens``: ``--n`` captions of BERT-like token features (10..19 rows of 768
  float16), the text store's bulk.

Each store is written three ways: ``np.save`` (the baseline), ``StoreWriter`` (shard files
and commit markers laid out by ``features.store.raw``, checksummed as written) and
``ZarrApiWriter``: the same writer with every shard and marker written through Zarr's API
(``array[start:stop] = data``: its sharding codec, CRC-32C index; the files then read back
for their checksums, as the integrity design needs). The writers alternate over
``--rounds`` passes into fresh paths (removed between passes, untimed); the best pass
counts. All write into the page cache: the figures follow the machine's memory pressure.

    python benchmarks/store_write.py [--n 2048] [--rounds 3] [--cases demo,coco,tokens]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from features.store.spec import FieldSpec, Provenance, StoreConfig
from features.store.writer import StoreWriter


class ZarrApiWriter(StoreWriter):
    """The store writer with every shard file and commit marker written through Zarr's
    API instead of laid out by hand (the comparison the hand layout must win by 1.5x)."""

    _raw = False

    def _write_marker(self, shard: int, text: str) -> None:
        self.commits[shard] = text


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def regions_case(rng, n: int, r: int, d: int, extra: bool) -> tuple[dict, dict]:
    fields = {
        "features": FieldSpec((r, d), "float16"),
        "boxes": FieldSpec((r, 4), "float32"),
        "n_regions": FieldSpec((), "int32"),
        "image_hw": FieldSpec((2,), "int32"),
    }
    data = {
        "features": rng.standard_normal((n, r, d), dtype=np.float32).astype(np.float16),
        "boxes": rng.uniform(0, 600, (n, r, 4)).astype(np.float32),
        "n_regions": np.full(n, r, np.int32),
        "image_hw": np.tile(np.array([480, 640], np.int32), (n, 1)),
    }
    if extra:  # the demo's regions store also keeps classes and scores
        fields["classes"] = FieldSpec((r,), "int32")
        fields["scores"] = FieldSpec((r,), "float32")
        data["classes"] = rng.integers(0, 20, (n, r), dtype=np.int32)
        data["scores"] = rng.uniform(0, 1, (n, r)).astype(np.float32)
    return fields, data


def ragged_case(rng, n: int, dim: int, ids: bool) -> tuple[dict, dict]:
    """Ragged token rows of ``n`` captions (flat rows and per-caption cuts)."""
    lengths = rng.integers(10, 20, n)
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    fields = {"features": FieldSpec((dim,), "float16", ragged=True)}
    tokens = rng.standard_normal((int(cuts[-1]), dim), dtype=np.float32).astype(np.float16)
    data = {"features": (tokens, cuts)}
    if ids:  # the demo's text store: wordpiece ids, a document vector, a valid flag
        fields["wordpiece_ids"] = FieldSpec((), "int32", ragged=True)
        fields["document"] = FieldSpec((4 * dim,), "float16")
        fields["valid"] = FieldSpec((), "uint8")
        data["wordpiece_ids"] = (rng.integers(0, 30000, int(cuts[-1]), dtype=np.int32), cuts)
        data["document"] = rng.standard_normal((n, 4 * dim), dtype=np.float32).astype(np.float16)
        data["valid"] = np.ones(n, np.uint8)
    return fields, data


def nbytes(data: dict) -> int:
    return sum((v[0] if isinstance(v, tuple) else v).nbytes for v in data.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="COCO-sized images (2048: 300 MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="demo,coco,tokens")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="vse-store-write-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    wanted = set(args.cases.split(","))
    cases = {}
    if "demo" in wanted:
        cases["demo regions"] = regions_case(rng, 800, 10, 256, extra=True)
        cases["demo text"] = ragged_case(rng, 4000, 384, ids=True)
    if "coco" in wanted:
        cases["COCO regions"] = regions_case(rng, args.n, 36, 2048, extra=False)
    if "tokens" in wanted:
        cases["ragged tokens"] = ragged_case(rng, args.n, 768, ids=False)
    provenance = Provenance("bench", "1", {}, None, "m" * 64)
    sizes = ", ".join(f"{k} {nbytes(d) / 2**20:.0f} MB" for k, (_, d) in cases.items())
    print(f"{load()} at start; {sizes}")
    counter = [0]
    written: list[Path] = []  # removed between passes, outside the timed part

    def clean() -> None:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        written.clear()

    def fresh(suffix: str) -> Path:
        counter[0] += 1
        path = root / f"out{counter[0]}{suffix}"
        written.append(path)
        return path

    def npy(data: dict) -> None:
        with open(fresh(".npy"), "wb") as f:  # the same bytes, one file
            for value in data.values():
                np.save(f, value[0] if isinstance(value, tuple) else value)

    def store(writer_class, fields: dict, data: dict) -> None:
        first = next(iter(data.values()))
        n = len(first[1]) - 1 if isinstance(first, tuple) else len(first)
        keys = [f"s{i:07d}" for i in range(n)]
        path = fresh(".zarr")
        cfg = StoreConfig()
        with writer_class(path, "bench", fields, keys, provenance, cfg, log=lambda m: 0) as w:
            for shard in w.pending_shards():
                a, b = w.shard_range(shard)
                part = {}
                for name, value in data.items():
                    if isinstance(value, tuple):
                        rows, cuts = value
                        part[name] = [rows[cuts[i] : cuts[i + 1]] for i in range(a, b)]
                    else:
                        part[name] = value[a:b]
                w.write_shard(shard, part)

    writers = {}
    for case, (fields, data) in cases.items():
        writers[f"{case}: np.save (baseline)"] = (lambda d=data: npy(d), nbytes(data))
        for label, cls in (("hand layout", StoreWriter), ("Zarr API", ZarrApiWriter)):
            run = lambda c=cls, f=fields, d=data: store(c, f, d)  # noqa: E731
            writers[f"{case}: store, {label}"] = (run, nbytes(data))
    best = dict.fromkeys(writers, 0.0)
    try:
        for write, _ in writers.values():
            write()  # warm-up
            clean()
        for _ in range(args.rounds):
            for name, (write, size) in writers.items():
                start = time.perf_counter()
                write()
                best[name] = max(best[name], size / (time.perf_counter() - start))
                clean()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nCOCO-sized n={args.n}, best of {args.rounds} passes, {load()}")
    print(f"{'writer':<44}{'MB/s':>8}{'x .npy':>8}{'hand/Zarr':>11}")
    for name, rate in best.items():
        case = name.split(":")[0]
        base = best[f"{case}: np.save (baseline)"]
        ratio = ""
        if name.endswith("hand layout"):
            ratio = f"{rate / best[f'{case}: store, Zarr API']:.2f}"
        print(f"{name:<44}{rate / 2**20:>8.0f}{rate / base:>8.2f}{ratio:>11}")


if __name__ == "__main__":
    main()
