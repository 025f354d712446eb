"""Write ``tests/fixtures/butd/golden_detectron2.npz``: what upstream detectron2, with
:mod:`features.images.detectron2_backend`'s registrations, extracts from three of the
test photos (36 fixed regions, as ``generate_tsv.py``'s fixed count) with each reduced
checkpoint of :data:`CHECKPOINTS`: ``seeded`` (random values) and ``peaked`` (its class
and attribute heads scoring as a trained model's: one class clearly wins per region, and
classes and attributes vary between regions). ``tests/test_butd.py`` checks the native
model against it in every run, detectron2 installed or not.

The file holds, per checkpoint ``name``, ``name/field`` arrays (images, 36, ...) of the
extractor's region fields, and the versions that made it: ``torch_version``,
``torchvision_version``, ``detectron2_version`` and ``detectron2_commit`` (the commit of
the source detectron2 was built from, read from the archive pip installed it from where
that is still at hand; else "unknown").

Run where detectron2 is importable: ``python tools/make_butd_golden.py``."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(ROOT), str(ROOT.parent)]  # run as a script: the tests' and the project's

from butd_data import butd_state, peaked_head  # noqa: E402

FIXTURES = ROOT / "fixtures" / "butd"
PHOTOS = sorted((ROOT / "fixtures" / "photos").glob("*.jpg"))
GOLDEN = FIXTURES / "golden_detectron2.npz"
CONFIG = FIXTURES / "butd_r50_w8_attr_caffemaxpool.yaml"
GOLDEN_PHOTOS = PHOTOS[:3]
GOLDEN_PARAMS = {"min_boxes": 36, "max_boxes": 36, "proposals": 150}
VERSIONS = ("torch_version", "torchvision_version", "detectron2_version", "detectron2_commit")


def save(state: dict[str, np.ndarray], path: Path) -> Path:
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    return path


def seeded_state() -> dict[str, np.ndarray]:
    """The reduced network (ResNet-50 depth, width 8, 30 classes, 10 attributes) in
    py-bottom-up-attention's layout, seeded random values."""
    return butd_state(blocks=(3, 4, 6, 3), width=8, hidden=32, classes=31, attrs=11, seed=1)


def golden_checkpoint(path: Path) -> Path:
    """:func:`seeded_state` as a torch state dict."""
    return save(seeded_state(), path)


def peaked_checkpoint(path: Path) -> Path:
    """:func:`seeded_state` with :func:`butd_data.peaked_head`'s heads, standardised on
    the features of the regions that the native model keeps with :func:`golden_checkpoint`
    on :data:`GOLDEN_PHOTOS`, as a torch state dict."""
    from features.images.config import RegionsConfig
    from features.images.extract import build_image_extractor

    cfg = RegionsConfig(weights=str(golden_checkpoint(path)), device="cpu", **GOLDEN_PARAMS)
    features = extract(build_image_extractor("regions", cfg), GOLDEN_PHOTOS)["features"]
    return save(peaked_head(seeded_state(), features, seed=5), path)


CHECKPOINTS = {"seeded": golden_checkpoint, "peaked": peaked_checkpoint}


def extract(extractor, photos) -> dict[str, np.ndarray]:
    """Kept regions of each photo, stacked: (images, 36, ...) arrays."""
    from PIL import Image

    rows = []
    for photo in photos:
        item = extractor.prepare(Image.open(photo).convert("RGB"), {})
        rows.append(extractor.regions([item])[0])
    return {k: np.stack([r[k].numpy() for r in rows]) for k in rows[0]}


def source_commit() -> str:
    """The commit of the source archive pip built the importable detectron2 from (git
    archive writes it into the tar header), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        origin = json.loads(distribution("detectron2").read_text("direct_url.json") or "{}")
    except PackageNotFoundError:
        return "unknown"
    if "vcs_info" in origin:
        return origin["vcs_info"].get("commit_id", "unknown")
    url = origin.get("url", "")
    archive = Path(url.removeprefix("file://"))
    if url.startswith("file://") and archive.is_file() and tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tar:
            return tar.pax_headers.get("comment", "unknown")
    return "unknown"


def versions() -> dict[str, str]:
    import detectron2
    import torchvision

    found = {
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "detectron2_version": detectron2.__version__,
        "detectron2_commit": source_commit(),
    }
    assert tuple(found) == VERSIONS
    return found


def main() -> None:
    import tempfile

    from features.images.config import RegionsConfig
    from features.images.detectron2_backend import build_detectron2_extractor

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, checkpoint in CHECKPOINTS.items():
            cfg = RegionsConfig(
                weights=str(checkpoint(Path(tmp) / f"{name}.pth")),
                backend="detectron2",
                detectron2_config=str(CONFIG),
                device="cpu",
                **GOLDEN_PARAMS,
            )
            regions = extract(build_detectron2_extractor(cfg, torch.device("cpu")), GOLDEN_PHOTOS)
            out.update({f"{name}/{k}": v for k, v in regions.items()})
    found = versions()
    np.savez_compressed(
        GOLDEN,
        photos=np.array([p.name for p in GOLDEN_PHOTOS]),
        **{k: np.array(v) for k, v in found.items()},
        **out,
    )
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes): {found}")


if __name__ == "__main__":
    main()
