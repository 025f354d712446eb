"""Write ``tests/fixtures/butd/golden_detectron2.npz``: what upstream detectron2, with
:mod:`features.images.detectron2_backend`'s registrations, extracts from three of the
test photos with the reduced checkpoint of :func:`golden_checkpoint` (36 fixed regions,
as ``generate_tsv.py``'s fixed count). ``tests/test_butd.py::test_native_matches_golden``
checks the native model against it in every run, detectron2 installed or not.

Run where detectron2 is importable: ``python tests/make_butd_golden.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]  # run as a script: the tests' and the project's

from butd_data import butd_state  # noqa: E402

FIXTURES = ROOT / "fixtures" / "butd"
PHOTOS = sorted((ROOT / "fixtures" / "photos").glob("*.jpg"))
GOLDEN = FIXTURES / "golden_detectron2.npz"
CONFIG = FIXTURES / "butd_r50_w8_attr_caffemaxpool.yaml"
GOLDEN_PHOTOS = PHOTOS[:3]
GOLDEN_PARAMS = {"min_boxes": 36, "max_boxes": 36, "proposals": 150}


def golden_checkpoint(path: Path) -> Path:
    """The reduced checkpoint (ResNet-50 depth, width 8, 30 classes, 10 attributes) in
    py-bottom-up-attention's layout, as a torch state dict."""
    state = butd_state(blocks=(3, 4, 6, 3), width=8, hidden=32, classes=31, attrs=11, seed=1)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    return path


def extract(extractor, photos) -> dict[str, np.ndarray]:
    """Kept regions of each photo, stacked: (images, 36, ...) arrays."""
    from PIL import Image

    rows = []
    for photo in photos:
        item = extractor.prepare(Image.open(photo).convert("RGB"), {})
        rows.append(extractor.regions([item])[0])
    return {k: np.stack([r[k].numpy() for r in rows]) for k in rows[0]}


def main() -> None:
    import tempfile

    from features.images.config import RegionsConfig
    from features.images.detectron2_backend import build_detectron2_extractor

    with tempfile.TemporaryDirectory() as tmp:
        cfg = RegionsConfig(
            weights=str(golden_checkpoint(Path(tmp) / "butd.pth")),
            backend="detectron2",
            detectron2_config=str(CONFIG),
            device="cpu",
            **GOLDEN_PARAMS,
        )
        out = extract(build_detectron2_extractor(cfg, torch.device("cpu")), GOLDEN_PHOTOS)
    np.savez_compressed(GOLDEN, photos=np.array([p.name for p in GOLDEN_PHOTOS]), **out)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
