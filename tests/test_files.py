"""Atomic outputs: every writer, SIGKILLed before each of its renames (what puts a file in
place) and just after each of its opens of a file for writing, into an empty folder and
over a complete earlier output, leaves each output absent, as it was, or whole; a rerun
ends with exactly the uninterrupted result and sweeps what the killed run left aside."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.cli import main
from infra.files import atomic_path, sweep_stale, write_json, write_text

JOB = Path(__file__).parent / "jobs" / "kill_job.py"
MATPLOTLIB = ["matplotlib.pyplot", "models.report"]
REPO = Path(__file__).parent.parent


def tree(path: Path):
    """A file's bytes, a folder's files by name, or None if absent."""
    if path.is_file():
        return path.read_bytes()
    if path.is_dir():
        return {
            str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
        }
    return None


def check_kills(base: Path, argv, outs, preload=()):
    """Kill ``vse argv`` at every rename and every open for writing, into an empty folder
    and over a complete earlier output (kill_job.py), then check each run's folder:
    outputs absent or equal to the clean run's, nothing else visible; then rerun it here
    and check it ends equal to the clean run, with nothing left aside."""
    base.mkdir(parents=True, exist_ok=True)
    spec = base / "spec.json"
    spec.write_text(json.dumps({"argv": argv, "base": str(base), "preload": list(preload)}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(JOB), str(spec)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    runs = result["runs"]
    assert runs.pop("clean") == "exit 0", done.stderr[-3000:]
    assert runs["over"] == "exit 0", done.stderr[-3000:]
    counts = result["counts"]
    assert min(counts["clean"]) >= 1 and counts["over"][0] >= 1, counts  # it writes
    points = sum(counts["clean"]) + sum(counts["over"])
    assert len(runs) == points + 1
    clean = {out: tree(base / "clean" / out) for out in outs}
    assert all(v is not None for v in clean.values())
    tops = {out.split("/")[0] for out in outs}
    for name, state in runs.items():
        assert state == ("exit 0" if name == "over" else "killed"), (name, state)
        folder = base / name
        for out in outs:
            assert tree(folder / out) in (None, clean[out]), (name, out, "half-written")
        visible = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
        assert visible <= {*tops, *(f"{o}.incomplete" for o in tops)}, (name, visible)
        argv_here = [a.replace("{dir}", str(folder)) for a in argv]
        assert main(argv_here) == 0, name
        for out in outs:
            assert tree(folder / out) == clean[out], (name, out, "rerun")
        assert sorted(p.name for p in folder.iterdir()) == sorted(tops), name
        assert not [p for p in folder.rglob(".*")], (name, "left aside")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A small demo dataset, its manifest, a store, a precomp folder, evaluation results."""
    root = tmp_path_factory.mktemp("inputs")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["demo"].update(n_train=24, n_val=4, n_test=4, image_size=64)
    params["store"].update(samples_per_shard=4, samples_per_chunk=2)
    params["shards"] = {"samples_per_shard": 5}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    p = str(root / "params.yaml")
    assert main(["--params", p, "demo-data", "--out", str(root / "demo")]) == 0
    args = ["--annotations", str(root / "demo/dataset.json"), "--images", str(root / "demo/images")]
    outs = ["--out", str(root / "m.parquet"), "--errors", str(root / "e.csv")]
    assert main(["--params", p, "prepare", *args, *outs, "--metrics", str(root / "j.json")]) == 0
    precomp = root / "precomp"
    precomp.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train", 9), ("test", 3)):
        np.save(precomp / f"{name}_ims.npy", rng.standard_normal((n, 5, 8)).astype(np.float32))
        (precomp / f"{name}_caps.txt").write_text("".join(f"c {name} {i}\n" for i in range(2 * n)))
    precomp_args = ["store", "import-precomp", str(precomp), "--splits", "train", "test"]
    store = ["--manifest", str(root / "pm.parquet"), "--out", str(root / "pr.zarr")]
    assert main(["--params", p, *precomp_args, *store]) == 0
    results = []
    for name, rsum in (("vsepp", 100.0), ("huse", 50.0)):
        metrics = {f"{d}_r{k}": rsum / 6 for d in ("i2t", "t2i") for k in (1, 5, 10)}
        metrics.update(i2t_medr=3.0, i2t_meanr=4.0, t2i_medr=3.0, t2i_meanr=4.0, rsum=rsum)
        report = {"model": name, "split": "test", "images": 4, "captions": 20, "full": metrics}
        results.append(root / f"{name}.json")
        results[-1].write_text(json.dumps(report))
    return root, p, precomp_args, results


def test_prepare_killed_anywhere(inputs, tmp_path):
    root, p, _, _ = inputs
    argv = ["--params", p, "prepare", "--annotations", str(root / "demo/dataset.json")]
    argv += ["--images", str(root / "demo/images"), "--out", "{dir}/m.parquet"]
    argv += ["--errors", "{dir}/e.csv", "--metrics", "{dir}/j.json"]
    check_kills(tmp_path, argv, ["m.parquet", "e.csv", "j.json"], ["features.ingest"])


def test_demo_data_killed_anywhere(tmp_path):
    """Three images (each image's open is the same moment: inside the folder built aside)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["demo"].update(n_train=1, n_val=1, n_test=1, image_size=64)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    argv = ["--params", str(tmp_path / "params.yaml"), "demo-data", "--out", "{dir}/demo"]
    check_kills(tmp_path / "kills", argv, ["demo"], ["features.demo"])


def test_shards_build_killed_anywhere(inputs, tmp_path):
    """The issue's case: a killed build left a sizes.json listing deleted and half-written
    tars; now the folder is the old one, absent, or the new one."""
    root, p, _, _ = inputs
    argv = ["--params", p, "shards", "build", "--manifest", str(root / "pm.parquet")]
    argv += ["--out", "{dir}/shards", "--store", f"regions={root / 'pr.zarr'}"]
    check_kills(tmp_path, argv, ["shards"], ["features.shards", "webdataset", "zarr"])


def test_import_precomp_killed_anywhere(inputs, tmp_path):
    _, p, precomp_args, _ = inputs
    argv = ["--params", p, *precomp_args, "--manifest", "{dir}/m.parquet", "--out", "{dir}/r.zarr"]
    check_kills(tmp_path, argv, ["m.parquet", "r.zarr"], ["features.exchange.precomp"])


def test_export_precomp_and_report_killed_anywhere(inputs, tmp_path):
    root, _, _, results = inputs
    argv = ["store", "export-precomp", str(root / "pr.zarr"), "--manifest"]
    argv += [str(root / "pm.parquet"), "--split", "train", "--out", "{dir}/e"]
    outs = [f"e/train_{x}" for x in ("ims.npy", "caps.txt", "ids.txt")]
    check_kills(tmp_path / "export", argv, outs, ["features.exchange.precomp", "zarr"])
    argv = ["report", *map(str, results), "--out", "{dir}/models.md", "--plot", "{dir}/m.png"]
    check_kills(tmp_path / "report", argv, ["models.md", "m.png"], MATPLOTLIB)


def test_temporary_names_are_unique_and_stale_ones_are_swept(tmp_path):
    out = tmp_path / "out.json"
    dead = 2**22 + 12345  # no such process
    (tmp_path / f".out.json.{dead}.abc.tmp").write_text("left by a killed writer")
    (tmp_path / f".out.json.old-{dead}").mkdir()
    (tmp_path / f".out.json.{os.getpid()}.xyz.tmp").write_text("a live writer's")
    with atomic_path(out) as a, atomic_path(out) as b:
        assert a != b and a.name.startswith(f".out.json.{os.getpid()}.")
        a.write_text("a")
        b.write_text("b")
    assert out.read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".out.json.{os.getpid()}.xyz.tmp",
        "out.json",
    ]
    sweep_stale(out)
    write_text(out, "c")
    assert out.read_text() == "c"


def test_atomic_outputs_are_readable_by_the_team(tmp_path):
    """mkstemp/mkdtemp make 0600 files and 0700 folders; outputs shared through DVC and
    file systems are 0644 and 0755 once in place."""
    with atomic_path(tmp_path / "out.json") as tmp:
        tmp.write_text("{}")
    with atomic_path(tmp_path / "folder", directory=True) as tmp:
        (tmp / "a.png").write_bytes(b"x")
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "folder").stat().st_mode & 0o777 == 0o755


def test_write_json_rounds_only_the_floats_to_the_digits_asked(tmp_path):
    data = {"mean": 0.123456789, "rows": [3, 2.00000004, True, "0.123456"], "tiny": {"p": 4e-9}}
    write_json(tmp_path / "m.json", data, digits=4)
    back = json.loads((tmp_path / "m.json").read_text())
    assert back == {"mean": 0.1235, "rows": [3, 2.0, True, "0.123456"], "tiny": {"p": 0.0}}
    assert isinstance(back["rows"][0], int) and back["rows"][2] is True
    write_json(tmp_path / "full.json", data)
    assert json.loads((tmp_path / "full.json").read_text()) == data
