"""``vse shards build``: pack training samples into WebDataset shards for streaming.

Not a DVC stage: the DAG trains from the feature stores (memory-mapped on one machine),
and shards duplicate the stores' bytes, so they are built on demand for streaming
training (many machines, object storage): set ``train.shards`` to the output folder or
URL. Pack the stores the model trains from (its image store and the text store, and the
scene graphs for UniVSE); training checks the shards against them.
"""

from __future__ import annotations

import time
from pathlib import Path

from flows.commands import command, path_in, path_out, progress


def _named_paths(items: list[str], option: str) -> dict[str, str]:
    from features.store.spec import StoreError

    named = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise StoreError(f"{option} {item!r}: expected NAME=PATH, e.g. regions=data/x.zarr")
        named[name] = path
    return named


def arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest parquet (vse prepare)")
    path_out(p, "--out", help="output folder of the shards, or a URL (s3://bucket/shards)")
    p.add_argument(
        "--storage-options",
        help='fsspec options of --out as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    p.add_argument(
        "--store",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a feature store to pack, e.g. regions=data/features/regions.zarr (repeatable)",
    )
    path_in(p, "--text", help="caption-level text store: pack its token ids per caption")
    path_in(
        p,
        "--scenegraphs",
        help="scene-graph folder (vse extract scenegraph): pack each caption's graph",
    )


@command(
    "shards build",
    help="pack per-split training samples into tar shards (params: shards)",
    description="Pack captions, labels, ground-truth boxes and the fields of the given "
    "stores into {split}-NNNNNN.tar shards with a sizes.json.",
    arguments=arguments,
    sections=("shards",),
)
def run(args, params) -> None:
    from features.ingest.manifest import read_manifest
    from features.scenegraph.files import GRAPHS
    from features.shards.writer import build_shards, read_scene_graphs
    from features.store.reader import Store
    from flows.commands.store import _storage_options
    from infra.files import sha256_file

    manifest = read_manifest(Path(args.manifest))
    stores = {
        name: Store.open(path, manifest_digest=manifest.digest)
        for name, path in _named_paths(args.store, "--store").items()
    }
    text = (
        Store.open(args.text, kind="text", manifest_digest=manifest.digest) if args.text else None
    )
    graphs = digest = None
    if args.scenegraphs:
        graphs = read_scene_graphs(Path(args.scenegraphs))
        digest = sha256_file(Path(args.scenegraphs) / GRAPHS)
    start = time.perf_counter()
    sizes = build_shards(
        manifest,
        stores,
        args.out,
        params.shards,
        progress=progress("shards", unit="shard"),
        text=text,
        scene_graphs=graphs,
        scene_graphs_digest=digest,
        storage_options=_storage_options(args),
    )
    seconds = time.perf_counter() - start
    images = sum(s["images"] for s in sizes["shards"].values())
    packed = ", ".join([*stores, *(["text"] if text else [])]) or "no feature stores"
    print(
        f"shards: {images} images in {len(sizes['shards'])} shards ({packed}) to {args.out} "
        f"in {seconds:.1f} s ({images / max(seconds, 1e-9):.0f} images/s)"
    )
