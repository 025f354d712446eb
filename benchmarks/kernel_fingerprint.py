"""Which CPU kernels give the same bits on two machines: a fingerprint of this one.

Under the kernels and threads ``vse`` pins (:mod:`infra.kernels`), computes a few
operations the stages run, from seeded inputs, and hashes their results (MD5 of the
bytes, first 12 hex digits):

- ``mkl_matmul``: a float32 matrix product and its gradients (MKL's sgemm: the text
  stage's BERT and every linear layer);
- ``numpy_dot``, ``numpy_eigh``: OpenBLAS's product and LAPACK's eigendecomposition (the
  global stage's PCA);
- ``convolutions`` with oneDNN and NNPACK on (torch's default on CPU) and off (the
  convolutions then run as im2col and MKL's sgemm): each kind of a ResNet's
  convolutions alone, its forward pass and both gradients hashed apart, so that a
  difference names the kernel; and ``resnet18_step``, one whole training step;
- ``conv1d_dilated`` (CAMERA's text convolutions), with oneDNN on and off;
- ``torch_sqrt``: torch's float32 ``sqrt``, which goes to MKL's vector math (its last bit
  follows the CPU under every ``MKL_CBWR`` branch; the pipeline does not call it), and
  ``adamw``: two AdamW steps with torch's for-each kernel (which takes that ``sqrt``) and
  with the fused one the trainers use (:func:`infra.kernels.adamw`).

Run it on two machines (or under ``qemu-x86_64 -cpu Haswell-v4``, an emulated Intel CPU;
``--label`` names it in the JSON) and compare the JSONs: an operation whose hashes differ does not
reproduce across those CPUs under the pinned kernels. The committed results
(``benchmarks/results/kernels/``) name their CPU.

    python benchmarks/kernel_fingerprint.py [--out benchmarks/results/kernels/NAME.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from infra import kernels  # noqa: E402

kernels.pin()  # before numpy or torch loads, as `vse` does

import numpy as np  # noqa: E402
import torch  # noqa: E402

# torch.backends.mkldnn.flags() sets oneDNN's TF32 flag too, which warns on a CPU-only run
warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")


def digest(*arrays) -> str:
    md5 = hashlib.md5()
    for a in arrays:
        a = a.detach().numpy() if isinstance(a, torch.Tensor) else a
        md5.update(np.ascontiguousarray(a).tobytes())
    return md5.hexdigest()[:12]


def cpu() -> dict:
    """Model, vendor, the widest vector extension and the cache sizes (sysfs)."""
    info = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags", "").split()
    info["model"] = fields.get("model name")
    info["vendor"] = fields.get("vendor_id")
    info["avx512f"], info["avx2"] = "avx512f" in flags, "avx2" in flags
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text()
            caches[f"L{level}{kind.strip()[0].lower()}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    info["caches"] = caches
    return info


def matmul() -> str:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 700, generator=g, requires_grad=True)
    b = torch.randn(700, 500, generator=g, requires_grad=True)
    (a @ b).square().sum().backward()
    return digest(a @ b, a.grad, b.grad)


CONVS = {  # ResNet-18's kinds of convolution: (in, out, kernel, stride, input side)
    "conv7x7s2": (3, 64, 7, 2, 128),
    "conv3x3s1": (64, 64, 3, 1, 32),
    "conv3x3s2": (64, 128, 3, 2, 32),
    "conv1x1s2": (64, 128, 1, 2, 32),
}


def convolutions(onednn: bool) -> dict[str, str]:
    """Each kind of convolution alone (batch 8, seeded input and output gradient): the
    hashes of its output, its input's gradient and its weight's gradient."""
    out = {}
    with torch.backends.mkldnn.flags(enabled=onednn), torch.backends.nnpack.flags(onednn):
        for name, (c_in, c_out, k, stride, side) in CONVS.items():
            g = torch.Generator().manual_seed(0)
            conv = torch.nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=False)
            with torch.no_grad():
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.1)
            x = torch.randn(8, c_in, side, side, generator=g, requires_grad=True)
            y = conv(x)
            y.backward(torch.randn(y.shape, generator=g))
            out[f"{name} forward"] = digest(y)
            out[f"{name} backward_data"] = digest(x.grad)
            out[f"{name} backward_weights"] = digest(conv.weight.grad)
    return out


def resnet_step(onednn: bool) -> str:
    """One training step's gradients of a ResNet-18 at 128 px, batch 8."""
    import torchvision

    with torch.backends.mkldnn.flags(enabled=onednn), torch.backends.nnpack.flags(onednn):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(8, 3, 128, 128, generator=torch.Generator().manual_seed(1))
        model(x).logsumexp(1).sum().backward()
    return digest(*(p.grad for p in model.parameters()))


def conv1d(onednn: bool) -> str:
    with torch.backends.mkldnn.flags(enabled=onednn), torch.backends.nnpack.flags(onednn):
        torch.manual_seed(0)
        conv = torch.nn.Conv1d(64, 32, 3, dilation=2, padding=2)
        x = torch.randn(16, 64, 40, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = conv(x)
        y.square().sum().backward()
    return digest(y, x.grad, conv.weight.grad)


def adamw(fused: bool) -> str:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 3, 7, 7, generator=g) * 0.1)
    optimizer = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-4, fused=fused, foreach=not fused)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=g) * 0.01
        optimizer.step()
    return digest(p)


def fingerprint(label: str | None) -> dict:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 700)), rng.standard_normal((700, 500))
    sym = a[:, :300].T @ a[:, :300]
    return {
        "cpu": cpu(),
        "label": label,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": torch.get_num_threads(),
        "hashes": {
            "mkl_matmul": matmul(),
            "numpy_dot": digest(a @ b),
            "numpy_eigh": digest(*np.linalg.eigh(sym)),
            "convolutions[onednn]": convolutions(True),
            "convolutions[no onednn]": convolutions(False),
            "resnet18_step[onednn]": resnet_step(True),
            "resnet18_step[no onednn]": resnet_step(False),
            "conv1d_dilated[onednn]": conv1d(True),
            "conv1d_dilated[no onednn]": conv1d(False),
            "torch_sqrt": digest(torch.linspace(1e-3, 7.0, 4099).sqrt()),
            "adamw[for-each]": adamw(fused=False),
            "adamw[fused]": adamw(fused=True),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--label", help="what runs it, where /proc/cpuinfo cannot tell (qemu)")
    args = parser.parse_args()
    result = fingerprint(args.label)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
