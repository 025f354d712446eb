"""``vse extract global`` (stage ``global``): one vector per image, the mean of a grid's
conv5 map or of an image's regions, and its PCA fitted on train."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command, path_in, path_out


def arguments(p) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    path_in(source, "--grid", help="grid store (vse extract grid): its pooled conv5 features")
    path_in(source, "--regions", help="... or a regions store: the mean of its valid regions")
    path_in(p, "--manifest", required=True, help="manifest parquet")
    path_out(p, "--out", help="global store to write")


@command(
    "extract global",
    help="global image features + PCA projection fitted on train (params: global)",
    arguments=arguments,
    sections=("global", "store"),
)
def run(args, params) -> None:
    from features.images.global_features import extract_global
    from features.ingest.manifest import read_manifest

    manifest = read_manifest(Path(args.manifest))
    store = extract_global(
        Path(args.grid or args.regions),
        manifest,
        Path(args.out),
        params.global_.projection_dim,
        params.store,
    )
    dims = ", ".join(f"{k} {v.shape}" for k, v in store.fields.items())
    print(f"extract global: {len(store)} images -> {args.out} ({dims})")
