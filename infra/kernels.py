"""The same floats on every x86-64 machine: numpy's and torch's CPU kernels and thread
counts chosen by the pipeline, not by the machine.

Each library picks its kernels by the CPU and splits work by the cores it finds; another
kernel or thread count adds in another order, the last bits change, and with them every
hash in ``dvc.lock`` downstream. :func:`pin`, which ``vse`` calls before numpy or torch
loads, makes the same choice on every x86-64 CPU (AVX2 is on every server CPU since 2013):

=====================  ===========================  ===================================
library                variable                     value
=====================  ===========================  ===================================
OpenBLAS               ``OPENBLAS_CORETYPE``         ``Haswell`` (AVX2 and FMA)
torch's vector code    ``ATEN_CPU_CAPABILITY``       ``avx2``
oneDNN                 ``ONEDNN_MAX_CPU_ISA``        ``AVX2``
MKL                    ``MKL_CBWR``                  ``COMPATIBLE``: the one branch MKL
                                                     keeps the same on Intel and AMD
numpy's vector code    ``NPY_ENABLE_CPU_FEATURES``   ``X86_V3`` (AVX2 and FMA; its
                                                     AVX-512 loops of ``exp``, ``log``,
                                                     ``power``... round otherwise), on a
                                                     CPU that has them: numpy refuses
                                                     to load with a feature it lacks
threads                ``OMP_NUM_THREADS``, ...      :data:`THREADS`
=====================  ===========================  ===================================

One kernel no variable pins: torch's float ``sqrt`` (and ``asin``, ``acos``, ``atan``) on
CPU calls MKL's vector math, whose last bit differs between Intel and AMD CPUs under every
``MKL_CBWR`` branch. The pipeline's code does not call them on tensors: its optimizers are
:func:`adamw` (the fused kernel takes its square roots in torch's own vector code), and the
detector's FPN level takes its square root in float64
(:class:`features.detector.model.LevelMapper64`).

``VSE_CPU_THREADS`` sets another thread count (faster; last bits then differ from a run
with another count); ``VSE_CPU_KERNELS=native`` leaves every choice to the machine
(fastest; outputs agree with another machine's only within a tolerance, which ``vse store
compare`` measures). CUDA kernels are not affected.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping
from pathlib import Path

from infra.config import UserError

THREADS = 2  # the demo machine's cores
THREADS_VARIABLE = "VSE_CPU_THREADS"
KERNELS_VARIABLE = "VSE_CPU_KERNELS"  # "pinned" (the default) or "native"

X86_KERNELS = {
    "OPENBLAS_CORETYPE": "Haswell",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
}
NUMPY_KERNELS = {"NPY_ENABLE_CPU_FEATURES": "X86_V3"}
# what numpy's X86_V3 needs, as /proc/cpuinfo names it (abm: LZCNT)
X86_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_flags() -> set[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    lines = (line.split(":", 1) for line in text.splitlines() if line.startswith("flags"))
    return next((set(value.split()) for _, value in lines), set())


def pin(
    environ: MutableMapping[str, str] | None = None,
    machine: str | None = None,
    flags: set[str] | None = None,
) -> None:
    """Set the kernel and thread variables above in ``environ`` (default: this process's
    environment, before numpy or torch loads: the libraries read them once, when they
    load); numpy's where ``flags`` (default: this CPU's) hold X86_V3. A torch already
    loaded gets the thread count at least."""
    environ = os.environ if environ is None else environ
    mode = environ.get(KERNELS_VARIABLE, "pinned").strip().lower() or "pinned"
    if mode not in ("pinned", "native"):
        raise UserError(f"{KERNELS_VARIABLE}={mode!r}: give 'pinned' (the default) or 'native'")
    if mode == "native":
        return
    threads = environ.get(THREADS_VARIABLE, "").strip() or str(THREADS)
    if not threads.isdigit() or int(threads) < 1:
        raise UserError(f"{THREADS_VARIABLE}={threads!r}: give a whole number of threads, >= 1")
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        environ.update(X86_KERNELS)
        if X86_V3_FLAGS <= (cpu_flags() if flags is None else flags):
            environ.update(NUMPY_KERNELS)
    environ.update(dict.fromkeys(THREAD_VARIABLES, threads))
    if environ is os.environ and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def adamw(params, lr: float, weight_decay: float):
    """``torch.optim.AdamW`` (Loshchilov and Hutter 2019, Algorithm 2) with its fused kernel:
    the for-each and per-tensor kernels take ``sqrt`` of the second moment through MKL's
    vector math, which rounds the last bit differently on Intel and AMD CPUs."""
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
