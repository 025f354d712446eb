"""The demo dataset that the feature tests read, built and ingested as ``prepare`` does."""

from pathlib import Path

from features.demo import DemoConfig, build_dataset
from features.ingest.manifest import Manifest, read_manifest, write_manifest
from features.ingest.readers import READERS, PrepareConfig
from features.ingest.validate import validate


def demo_manifest(root: Path, **demo) -> Manifest:
    """Build the demo dataset in ``root`` (``demo``: DemoConfig's fields, e.g. n_train,
    n_val, n_test, image_size), validate it and write its manifest to
    ``root/manifest.parquet``; return the manifest read back."""
    build_dataset(DemoConfig(**demo), root)
    dataset = READERS["demo"](root / "dataset.json", root / "images", PrepareConfig())
    records, _ = validate(dataset, root / "images", 5)
    write_manifest(records, dataset, 5, root / "manifest.parquet")
    return read_manifest(root / "manifest.parquet")
