"""Same outputs on another machine: ``vse`` pins numpy's and torch's CPU kernels and
thread counts (:mod:`infra.kernels`), so the stages whose outputs go through
floating-point kernels, rerun by force in a copy of the reproduced demo under the kernel
choices another machine would make, leave dvc.lock unchanged (byte-identical outputs)."""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_tree, run

from infra import kernels
from infra.config import UserError

# detector (a trained Faster R-CNN: convolutions, matrix products), regions (its forward
# pass into float16), text (BERT into float16), global (a PCA: an eigendecomposition),
# sbert_stats (Sentence-BERT similarities into metrics and plots), graph_rise (a kNN
# graph, a trained head, precisions), train@huse (trained on graph_rise's store, with
# Sentence-BERT class distances), train@mvvse (GPO pooling, a GRU)
STAGES = [
    "detector",
    "regions",
    "text",
    "global",
    "sbert_stats",
    "graph_rise",
    "train@huse",
    "train@mvvse",
]

# What another x86-64 machine picks by itself, where this one picks AVX-512 kernels and
# two threads: OpenBLAS's kernels for an older CPU (Prescott: SSE3 only), oneDNN without
# AVX-512, MKL's AVX2 branch, torch's default vector kernels, one thread.
ANOTHER_MACHINE = {
    "OPENBLAS_CORETYPE": "Prescott",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_CBWR": "AVX2",
    "ATEN_CPU_CAPABILITY": "default",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}

x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 kernel names")
QEMU = shutil.which("qemu-x86_64")
FINGERPRINT_JOB = Path(__file__).parent / "jobs" / "cpu_fingerprint_job.py"


def output_hashes(project) -> dict[str, str]:
    """``stage: path`` -> md5 of every output in the project's dvc.lock."""
    stages = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    return {
        f"{stage}: {out['path']}": out["md5"]
        for stage, entry in stages.items()
        for out in entry.get("outs", [])
    }


@x86_only
def test_stages_give_the_same_bytes_under_another_machines_kernels(
    reproduced, tmp_path, monkeypatch
):
    built, _ = reproduced
    before = output_hashes(built)
    project = copy_tree(built, tmp_path / "project")
    for name, value in ANOTHER_MACHINE.items():
        monkeypatch.setenv(name, value)
    forced = run(["dvc", "repro", "--force", "--single-item", *STAGES], project)
    assert all(f"Running stage '{stage}'" in forced.stdout for stage in STAGES)
    after = output_hashes(project)
    assert set(after) == set(before)
    changed = sorted(k for k in before if after[k] != before[k])
    assert not changed, f"these outputs changed under another machine's kernels: {changed}"


@x86_only
def test_a_vse_process_runs_the_pinned_kernels_whatever_the_machine_asks():
    """In the process ``vse`` runs a command in, torch reports AVX2 kernels and two
    threads, OpenBLAS its Haswell kernels and numpy its X86_V3 (AVX2) loops only, though
    the environment asked for others."""
    probe = (
        "from infra import kernels; kernels.pin(); "
        "import numpy, torch, threadpoolctl; "
        "blas = [i for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'openblas']; "
        "from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__; "
        "print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), "
        "blas[0]['architecture'], blas[0]['num_threads'], "
        "*[f for f in __cpu_dispatch__ if __cpu_features__[f]])"
    )
    env = {**os.environ, **ANOTHER_MACHINE, "ATEN_CPU_CAPABILITY": "avx512"}
    env["NPY_ENABLE_CPU_FEATURES"] = "X86_V3 X86_V4"
    env.pop(kernels.THREADS_VARIABLE, None)
    env.pop(kernels.KERNELS_VARIABLE, None)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["AVX2", "2", "Haswell", "2", "X86_V3"]


def test_pin_sets_each_library_and_the_thread_count():
    env = {"OPENBLAS_CORETYPE": "Prescott", "OMP_NUM_THREADS": "16"}
    kernels.pin(env, machine="x86_64", flags=kernels.X86_V3_FLAGS | {"avx512f"})
    assert env == {
        **kernels.X86_KERNELS,
        "NPY_ENABLE_CPU_FEATURES": "X86_V3",
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "OPENBLAS_NUM_THREADS": "2",
    }


def test_numpy_is_not_pinned_to_features_the_cpu_lacks():
    """numpy refuses to load when told to enable a feature the CPU lacks (no AVX2 here)."""
    env = {}
    kernels.pin(env, machine="x86_64", flags={"sse4_2", "avx"})
    assert "NPY_ENABLE_CPU_FEATURES" not in env and env["OPENBLAS_CORETYPE"] == "Haswell"


def test_pin_takes_another_thread_count_and_leaves_other_cpus_kernels():
    env = {kernels.THREADS_VARIABLE: "8"}
    kernels.pin(env, machine="aarch64")
    assert env == {
        kernels.THREADS_VARIABLE: "8",
        "OMP_NUM_THREADS": "8",
        "MKL_NUM_THREADS": "8",
        "OPENBLAS_NUM_THREADS": "8",
    }


def test_native_leaves_every_choice_to_the_machine():
    env = {kernels.KERNELS_VARIABLE: "native", "OMP_NUM_THREADS": "16"}
    kernels.pin(env, machine="x86_64")
    assert env == {kernels.KERNELS_VARIABLE: "native", "OMP_NUM_THREADS": "16"}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (kernels.THREADS_VARIABLE, "0"),
        (kernels.THREADS_VARIABLE, "two"),
        (kernels.KERNELS_VARIABLE, "fast"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable(name, value):
    with pytest.raises(UserError, match=f"^{name}='{value}': give ") as err:
        kernels.pin({name: value}, machine="x86_64")
    assert "\n" not in str(err.value)


def fingerprint(*emulator: str) -> dict[str, str]:
    """``tests/jobs/cpu_fingerprint_job.py``'s hashes, run on this CPU or under ``emulator``."""
    env = {k: v for k, v in os.environ.items() if k not in (*ANOTHER_MACHINE, "VSE_CPU_KERNELS")}
    out = subprocess.run(
        [*emulator, sys.executable, str(FINGERPRINT_JOB)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@x86_only
@pytest.mark.skipif(QEMU is None, reason="needs qemu-user (apt-get install qemu-user)")
def test_training_steps_give_the_same_bytes_on_an_emulated_intel_cpu():
    """Another CPU for real, not another choice of kernels on this one: qemu's Haswell
    (GenuineIntel, AVX2 without AVX-512, other cache sizes, its own results for the
    approximate instructions) runs the detector's and the five models' first steps and
    numpy's transcendental loops with the pinned kernels, and their results are bit for
    bit this CPU's. The control, torch's
    float32 ``sqrt`` (MKL's vector math), differs there: the emulated CPU does round some
    kernels otherwise, and the trainers avoid them (:func:`infra.kernels.adamw`)."""
    here = fingerprint()
    there = fingerprint(QEMU, "-cpu", "Haswell-v4")
    assert there.pop("control") != here.pop("control"), "the emulation rounds sqrt as this CPU"
    assert there == here
