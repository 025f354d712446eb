"""Hashes of a few training steps of the pipeline's trainers, for comparing two CPUs.

Prints one JSON object: ``control`` (torch's float32 ``sqrt`` of fixed inputs: MKL's vector
math, which rounds the last bit by the CPU; the pipeline never calls it), ``numpy`` (its
``exp``, ``log``, ``power``... in float32 and float64, under the pinned loops) and, after two
optimizer steps on fixed synthetic data, the parameters of the demo-shaped detector (a
ResNet-18 FPN at 128 px, so RoIs fall on two pyramid levels) and of each of the five
retrieval models. ``tests/test_kernels.py`` runs it here and under an emulated CPU.

    python tests/jobs/cpu_fingerprint_job.py
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from infra import kernels  # noqa: E402

kernels.pin()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from model_data import TinyPairs  # noqa: E402
from test_model_common import SMALL  # noqa: E402

from features.detector.config import DetectorConfig  # noqa: E402
from features.detector.loader import attribute_targets  # noqa: E402
from features.detector.model import build_detector_model  # noqa: E402
from features.detector.train import _losses  # noqa: E402
from models.registry import model_class  # noqa: E402


def digest(tensors) -> str:
    md5 = hashlib.md5()
    for t in tensors:
        md5.update(t.detach().contiguous().numpy().tobytes())
    return md5.hexdigest()[:12]


def steps(model, loss, n: int = 2) -> str:
    """``n`` steps of the pipeline's optimizer on ``loss()``; the parameters' hash."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = kernels.adamw(params, 1e-3, 1e-4)
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        torch.nn.utils.clip_grad_norm_(params, 2.0)
        optimizer.step()
    return digest(model.state_dict().values())


def detector() -> str:
    cfg = DetectorConfig(
        architecture="resnet18_fpn",
        anchor_sizes=[16, 24, 32, 48, 64, 96],
        fpn_levels=3,
        fpn_channels=16,
        representation_size=32,
        class_embedding=8,
        attribute_hidden=16,
        min_side=128,
        max_side=128,
        rpn_pre_nms_train=100,
        rpn_post_nms_train=60,
        box_batch_size=16,
    )
    torch.manual_seed(0)
    model = build_detector_model(cfg, 4, 3).train()
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 128, 128, generator=g) for _ in range(2)]
    boxes = torch.tensor([[4.0, 6.0, 60.0, 50.0], [30.0, 20.0, 126.0, 120.0]])
    targets = [
        {
            "boxes": boxes,
            "labels": torch.tensor([1, 3]),
            "attributes": attribute_targets([["red"], []], ["red", "blue", "big"]),
        }
        for _ in images
    ]
    return steps(model, lambda: sum(_losses(model, images, targets).values()))


def retrieval(name: str) -> str:
    data = TinyPairs(n_images=6)
    batch = {**data.pair_batch(np.arange(6)), "epoch": 3}
    torch.manual_seed(0)
    cls = model_class(name)
    model = cls(cls.Config(**SMALL[name]), data.info).train()

    def loss():
        if name == "univse":
            negatives = model.sample_negatives(batch, torch.Generator().manual_seed(0))
            return model.loss(batch, negatives)["loss"]
        return model.loss(batch)["loss"]

    return steps(model, loss)


def numpy_loops() -> str:
    """numpy's float32 and float64 loops whose AVX-512 code rounds otherwise than AVX2's."""
    x = np.linspace(0.01, 7.0, 4099)
    out = []
    for a in (x, x.astype(np.float32)):
        out += [np.exp(a), np.log(a), np.power(a, a.dtype.type(1.7)), np.log1p(a), np.arctan(a)]
    return digest(torch.from_numpy(a) for a in out)


def main() -> None:
    x = torch.linspace(1e-3, 7.0, 4099)
    out = {"control": digest([x.sqrt()]), "numpy": numpy_loops(), "detector": detector()}
    out.update({name: retrieval(name) for name in SMALL})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
