"""``vse store ls | info | verify | compare | import-precomp | import-tsv | import-npz |
export-precomp | export-tsv``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from flows.commands import command, path_in, path_out, progress, text_table


def _storage_options(args) -> dict | None:
    from features.store.spec import StoreError

    if not args.storage_options:
        return None
    try:
        return json.loads(args.storage_options)
    except json.JSONDecodeError as err:
        raise StoreError(f"--storage-options: not a JSON object ({err})") from None


def _url_arguments(p) -> None:
    p.add_argument(
        "url", help="store path or URL, e.g. data/features/regions.zarr or s3://b/r.zarr"
    )
    p.add_argument(
        "--storage-options",
        help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )


@command(
    "store ls",
    help="list the stores under a folder",
    arguments=lambda p: p.add_argument(
        "root", nargs="?", default="data", help="folder to search (default: data)"
    ),
    sections=None,
)
def run_ls(args, params) -> int:
    """Every store under the folder; a damaged one is listed as such (exit 1), the others
    still are."""
    from features.store.reader import Store, find_stores
    from features.store.spec import StoreError
    from flows.commands.pull import tree_bytes

    rows, damaged = [], []
    for path in find_stores(args.root):
        size = f"{tree_bytes(path) / 2**20:.1f} MB"
        try:
            store = Store.open(path, require_complete=False)
        except StoreError as err:
            damaged.append(str(err))
            rows.append((str(path), "?", "?", "damaged", "?", size))
            continue
        complete = store.committed.all()
        state = "complete" if complete else "partial " + store.describe()["committed_shards"]
        rows.append((str(path), store.kind, str(len(store)), state, store.fingerprint[:12], size))
    if not rows:
        print(f"no feature stores under {args.root}")
        return 0
    print(text_table(("path", "kind", "samples", "state", "fingerprint", "size"), rows))
    for message in damaged:
        print(f"error: {message}", file=sys.stderr)
    return 1 if damaged else 0


@command(
    "store info",
    help="show how a store was made: kind, fingerprint, inputs, layout",
    arguments=lambda p: (
        _url_arguments(p),
        p.add_argument("--json", action="store_true", help="print JSON instead of YAML"),
    ),
    sections=None,
)
def run_info(args, params) -> None:
    from features.store.reader import Store

    store = Store.open(args.url, require_complete=False, storage_options=_storage_options(args))
    info = store.describe()
    print(
        json.dumps(info, indent=2) if args.json else yaml.safe_dump(info, sort_keys=False), end=""
    )


@command(
    "store verify",
    help="recompute checksums; name every corrupt or missing file",
    arguments=_url_arguments,
    sections=None,
)
def run_verify(args, params) -> int:
    from features.store.integrity import verify_store
    from features.store.reader import Store

    problems = verify_store(args.url, _storage_options(args))
    for problem in problems:
        print(f"{args.url}: {problem}")
    if problems:
        print(
            f"verify: {len(problems)} problem(s) in {args.url}; rebuild the store (dvc repro) "
            "or restore it from the DVC cache (dvc checkout)",
            file=sys.stderr,
        )
        return 1
    store = Store.open(args.url, storage_options=_storage_options(args))
    print(f"verify: {args.url} is intact ({len(store)} samples, all shards committed)")
    return 0


def compare_arguments(p) -> None:
    p.add_argument("a", help="store path or URL")
    p.add_argument("b", help="the store to compare it with, the reference of --rtol")
    p.add_argument(
        "--atol", type=float, default=0.0, help="absolute tolerance (default 0: equal values)"
    )
    p.add_argument(
        "--rtol", type=float, default=0.0, help="tolerance relative to B's value (default 0)"
    )
    p.add_argument(
        "--fields", nargs="+", help="fields to compare (default: all, and the store-level arrays)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--storage-options",
        help='fsspec options as JSON for both stores, e.g. \'{"endpoint_url": "..."}\'',
    )


@command(
    "store compare",
    help="largest absolute and relative difference per field of two stores of the "
    "same samples, and whether within a tolerance",
    description="Stores made by the same code on any x86-64 CPU are the same bytes; "
    "one made on a GPU or with another torch version differs in the last bits of its "
    "floats. Exit 1 if a value is beyond |a - b| <= atol + rtol * |b|.",
    arguments=compare_arguments,
    sections=None,
)
def run_compare(args, params) -> int:
    """Largest absolute and relative difference per field; exit 1 if one is beyond
    ``atol + rtol * |b|``."""
    from features.store.compare import compare_stores
    from features.store.reader import Store

    options = _storage_options(args)
    a, b = (Store.open(url, storage_options=options) for url in (args.a, args.b))
    diffs = compare_stores(a, b, args.atol, args.rtol, args.fields)
    beyond = [d.name for d in diffs if not d.within]
    if args.json:
        print(json.dumps([d.as_dict() for d in diffs], indent=2))
    else:
        header = ("field", "dtype", "values", "differing", "max abs", "max rel", "within")
        rows = [
            (
                d.name,
                d.dtype,
                str(d.values),
                str(d.differing),
                f"{d.max_abs:.3g}",
                f"{d.max_rel:.3g}",
                "yes" if d.within else "NO",
            )
            for d in diffs
        ]
        print(text_table(header, rows))
        identical = sum(d.identical for d in diffs)
        print(
            f"compare: {identical} of {len(diffs)} identical, {len(diffs) - len(beyond)} "
            f"within atol {args.atol:g} + rtol {args.rtol:g} x |b|"
            + (f"; beyond it: {', '.join(beyond)}" if beyond else "")
        )
    return 1 if beyond else 0


def precomp_arguments(p) -> None:
    path_in(p, "folder", help="precomp folder, e.g. data/f30k_precomp")
    p.add_argument(
        "--splits",
        nargs="+",
        default=["train", "dev", "test"],
        help="precomp split names (dev -> val, testall -> test)",
    )
    path_out(p, "--manifest", help="manifest parquet to write")
    path_out(p, "--out", help="regions store to write")


@command(
    "store import-precomp",
    help="import a SCAN/VSE++ precomp folder as a manifest + regions store (params: store)",
    description="Reads {split}_ims.npy, {split}_caps.txt and {split}_ids.txt if present.",
    arguments=precomp_arguments,
    sections=("store",),
)
def run_import_precomp(args, params) -> None:
    from features.exchange.precomp import import_precomp

    manifest = import_precomp(
        Path(args.folder),
        args.splits,
        Path(args.manifest),
        Path(args.out),
        params.store,
        progress=progress("import", unit="shard"),
    )
    print(f"import: {len(manifest)} images of {args.splits} -> {args.manifest} and {args.out}")


def tsv_arguments(p) -> None:
    path_in(
        p,
        "tsv",
        nargs="+",
        help="TSV files: bottom-up-attention (image_id, image_w, image_h, num_boxes, boxes, "
        "features) or LXMERT's obj36 (img_id, img_h, img_w, objects_id, objects_conf, "
        "attrs_id, attrs_conf, num_boxes, boxes, features)",
    )
    _aligned_arguments(p)
    p.add_argument(
        "--format",
        choices=["auto", "butd", "obj36"],
        default="auto",
        help="TSV layout (default: told by the field count of the first rows: 6 or 10)",
    )


def _aligned_arguments(p) -> None:
    path_in(p, "--manifest", required=True, help="manifest the store is aligned with")
    path_out(p, "--out", help="regions store to write")
    p.add_argument("--max-regions", type=int, default=36, help="regions kept per image")


def _import_aligned(args, params, importer, source, what: str, **kwargs) -> None:
    """``importer(source, ...)`` into a regions store aligned with ``--manifest``; reports
    the manifest images that had no ``what``."""
    from features.ingest.manifest import read_manifest

    manifest = read_manifest(Path(args.manifest))
    missing = importer(
        source,
        manifest,
        Path(args.out),
        params.store,
        args.max_regions,
        progress=progress("import", unit="shard"),
        **kwargs,
    )
    print(f"import: {len(manifest) - len(missing)} of {len(manifest)} images -> {args.out}")
    if missing:
        print(
            f"import: {len(missing)} manifest images have no {what} (stored with 0 regions), "
            f"e.g. {', '.join(missing[:5])}"
        )


@command(
    "store import-tsv",
    help="import bottom-up-attention or obj36 TSV features for a manifest's images (params: store)",
    arguments=tsv_arguments,
    sections=("store",),
)
def run_import_tsv(args, params) -> None:
    from features.exchange.butd_tsv import import_butd_tsv

    tsv = [Path(f) for f in args.tsv]
    _import_aligned(args, params, import_butd_tsv, tsv, "TSV row", fmt=args.format)


def npz_arguments(p) -> None:
    path_in(p, "folder", help="MILVLG bottom-up-attention.pytorch folder of {image_id}.npz")
    _aligned_arguments(p)


@command(
    "store import-npz",
    help="import a MILVLG bottom-up-attention.pytorch .npz folder for a manifest's images "
    "(params: store)",
    arguments=npz_arguments,
    sections=("store",),
)
def run_import_npz(args, params) -> None:
    from features.exchange.milvlg_npz import import_npz

    _import_aligned(args, params, import_npz, Path(args.folder), ".npz file")


def export_arguments(p) -> None:
    path_in(p, "store", help="regions store")
    path_in(p, "--manifest", required=True, help="the manifest the store was built from")
    p.add_argument("--split", required=True, choices=["train", "val", "test"])
    path_out(p, "--out", help="output folder")
    p.add_argument("--regions", type=int, default=36, help="regions per image (pad or cut)")


def _regions_store(args):
    """``--manifest`` and the regions store ``args.store`` built from it."""
    from features.ingest.manifest import read_manifest
    from features.store.reader import Store

    manifest = read_manifest(Path(args.manifest))
    return manifest, Store.open(args.store, kind="regions", manifest_digest=manifest.digest)


@command(
    "store export-precomp",
    help="export one split of a regions store to the precomp layout",
    arguments=export_arguments,
    sections=None,
)
def run_export_precomp(args, params) -> None:
    from features.exchange.precomp import export_precomp

    manifest, store = _regions_store(args)
    path = export_precomp(store, manifest, args.split, Path(args.out), n_regions=args.regions)
    print(f"export: {args.split} -> {path} (+ captions and ids)")


def export_tsv_arguments(p) -> None:
    path_in(p, "store", help="regions store (with boxes)")
    path_in(p, "--manifest", required=True, help="the manifest the store was built from")
    p.add_argument("--split", choices=["train", "val", "test"], help="one split (default: all)")
    path_out(p, "--out", help="obj36 TSV file to write")


@command(
    "store export-tsv",
    help="export a regions store as an obj36 TSV file (LXMERT's load_obj_tsv reads it)",
    arguments=export_tsv_arguments,
    sections=None,
)
def run_export_tsv(args, params) -> None:
    from features.exchange.butd_tsv import export_obj36

    manifest, store = _regions_store(args)
    written, skipped = export_obj36(store, manifest, Path(args.out), args.split)
    print(f"export: {written} images -> {args.out} (obj36 TSV)")
    if skipped:
        print(
            f"export: {len(skipped)} images without regions left out, e.g. "
            f"{', '.join(skipped[:5])} (Store.notes() says why)"
        )
