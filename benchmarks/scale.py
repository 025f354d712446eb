"""How the whole DAG scales with the dataset's size: each stage's time, CPU, memory and
output, and DVC's own overhead, on the synthetic demo dataset grown to N images.

A run copies the project into a temp folder (``tests/conftest.py``'s ``copy_project``:
tracked and non-ignored files, a fresh git repo), sets the ``demo`` params to N images in
the demo's train/val/test proportions (five captions each, the demo's grammar), keeps every
model and training setting of ``params.yaml`` as it is, and runs the DAG through DVC one
stage at a time, in topological order (``dvc repro --single-item STAGE``). Each stage runs
under its own small wrapper process, so that the wrapper's ``getrusage(RUSAGE_CHILDREN)``
after the stage gives that stage alone:

- ``wall_s``: seconds of ``dvc repro --single-item`` (DVC's checks, hashing and caching
  included);
- ``cpu_s``: user + system CPU seconds of DVC, the stage's command and their children;
- ``peak_rss_mb``: the largest resident set of any one of those processes (``ru_maxrss``:
  the maximum over the processes, not the sum of ones running together, such as a data
  loader's worker beside its trainer). It counts the pages of memory-mapped store files
  the process has read, which are page cache the kernel drops under pressure;
- ``peak_anon_mb``, ``peak_file_mb``: the peaks of the anonymous memory (heap, tensors:
  what the stage holds) and of the file-backed resident pages (mapped store files,
  libraries), each summed over the processes running at once, sampled every 0.2 s;
- ``out_bytes``, ``out_files``: the size and file count of the stage's outputs (``outs``,
  ``metrics`` and ``plots`` of ``dvc.yaml``) after it.

Then DVC's overhead on the finished DAG: ``dvc status`` (``status_s``), and re-hashing and
committing every output (``hash_commit_s``: ``dvc commit --force`` after the hash database
of the project's ``core.site_cache_dir`` is removed, so every dependency and output is read
and hashed again, not looked up by modification time). With ``--s3``, also ``dvc push`` to
a local S3 endpoint (moto, ``tests/local_s3.py``) and ``dvc pull`` into a fresh clone of the
temp project that has no cache (moto serves from this process, in Python: these time DVC's
transfers against a slow server, not against S3). ``overhead_share`` is (status +
hash/commit) over the DAG's seconds (the sum of the stages' ``wall_s``).

The val and test splits grow with N here (the demo's proportions, 6:1:1), so validation and
evaluation, whose similarity matrices are (images x captions) of a split, grow as N squared;
COCO's Karpathy split keeps them at 5,000 images each, which N = 40,000 matches.

One JSON per N (``--out``); ``--plot`` draws CPU seconds against N per stage on log-log axes
from several JSONs, with each stage's fitted exponent (least-squares slope of log seconds
on log N; also of its CPU seconds, which a busy shared machine distorts less than wall
time), and writes the exponents and a projection of each stage's seconds and peak
memory at COCO's 123,287 images to ``summary.json``.

Targets:

- every stage's time exponent <= 1.1 between 5,000 and 40,000 images;
- peak RSS <= 4 GB at 40,000 images, and projected <= 12 GB at 123,287;
- DVC's overhead <= 5% of the DAG's time at 40,000 images.

Run (one DAG at a time; the temp folder is removed afterwards unless ``--keep``):

    python benchmarks/scale.py --images 5000 [--out benchmarks/results/scale/5000.json] [--s3]
    python benchmarks/scale.py --plot benchmarks/results/scale/*.json \\
        --out-plot benchmarks/results/scale/scale.png

A run longer than one sitting (40,000 images take about four hours on 2 cores) goes in a
folder of its own with ``--work DIR``: each stage's figures are written to
``DIR/stages.json`` as it finishes, and the same command run again skips the stages already
measured and goes on from the first that is not (a stage cut off midway runs again, whole).
Each stage's figures name the commit and the CPU it ran on. If the repository has moved on
since, the project's code is refreshed from it first (its ``params.yaml``, ``dvc.lock``
and the stages' outputs kept), so the stages still to run use the new code; a stage already
measured is not measured again (unless named in ``--again STAGE...``, which runs it by
force: to measure again a stage that shared the machine), and a stage whose code changed
is rerun by DVC when it comes. The folder is kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import yaml
from filelock import FileLock, Timeout

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "scale"
COCO_IMAGES = 123_287
WEB_IMAGES = 3_000_000  # a web-sized set (e.g. Conceptual Captions' 3.3M)
SPREAD = ("grid", "regions")  # the stages a Dask cluster spreads over machines
MACHINES = (1, 4, 16)
FIT_RANGE = (5_000, 40_000)  # the runs the targets' exponents are fitted on, when present
TARGETS = {
    "max_time_exponent": 1.1,
    "max_peak_rss_gb_at_40000": 4.0,
    "max_projected_peak_rss_gb_at_coco": 12.0,
    "max_overhead_share_at_40000": 0.05,
}


# -- the wrapper: one measured child process -------------------------------------------


def resident(pid: int) -> tuple[int, int]:
    """Anonymous and file-backed resident bytes of process ``pid`` and its descendants
    (``RssAnon``, ``RssFile`` of ``/proc/PID/status``); processes gone meanwhile count 0."""
    import psutil

    anon = file = 0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    for proc in procs:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        except OSError:
            continue
        kib = {
            k: int(v.split()[0])
            for k, _, v in (line.partition(":") for line in status)
            if k in ("RssAnon", "RssFile")
        }
        anon += kib.get("RssAnon", 0) << 10
        file += kib.get("RssFile", 0) << 10
    return anon, file


def measure(argv: list[str], log: Path) -> None:
    """Run ``argv`` (output appended to ``log``) and print its figures as one JSON line:
    this process's children are that command and its descendants alone."""
    peaks = [0, 0]
    with open(log, "a") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peaks = [max(p, r) for p, r in zip(peaks, resident(proc.pid), strict=True)]
            time.sleep(0.2)
        rc = proc.returncode
        wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "rc": rc,
                "wall_s": round(wall, 3),
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # Linux: KiB
                "peak_anon_mb": round(peaks[0] / 2**20, 1),
                "peak_file_mb": round(peaks[1] / 2**20, 1),
            }
        )
    )


def measured(argv: list[str], cwd: Path, log: Path, env: dict) -> dict:
    """``argv`` run in ``cwd`` under a wrapper process (:func:`measure`); its figures."""
    wrapper = [sys.executable, __file__, "--measure", str(log), "--", *argv]
    done = subprocess.run(wrapper, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the wrapper of {argv} failed:\n{done.stderr}")
    figures = json.loads(done.stdout.splitlines()[-1])
    if figures["rc"]:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{' '.join(argv)} exited {figures['rc']} (log {log}):\n{tail}")
    return figures


# -- the project copy ------------------------------------------------------------------


def scaled_params(n_images: int, epochs: int | None = None) -> tuple[str, dict]:
    """``params.yaml`` with the demo dataset at ``n_images`` in the demo's split
    proportions, and what changed ({key: [before, after]}).

    ``epochs``: every training stage (the detector, the Graph-RISE head, the retrieval
    models) trains that many epochs instead of its own, and LR decay steps past the last
    epoch are dropped; so a training stage's seconds measure how its epochs grow with N."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    demo = params["demo"]
    splits = ("n_train", "n_val", "n_test")
    total = sum(demo[s] for s in splits)
    sizes = {s: max(1, round(n_images * demo[s] / total)) for s in splits[1:]}
    sizes["n_train"] = n_images - sum(sizes.values())
    changed = {f"demo.{s}": [demo[s], sizes[s]] for s in splits if demo[s] != sizes[s]}
    demo.update(sizes)
    if epochs is not None:
        for section in ("detector", "graph_rise", "train"):
            changed[f"{section}.epochs"] = [params[section]["epochs"], epochs]
            params[section]["epochs"] = epochs
        decay = params["train"]["lr_decay_epochs"]
        kept = [e for e in decay if e < epochs]
        changed["train.lr_decay_epochs"] = [decay, kept]
        params["train"]["lr_decay_epochs"] = kept
    return yaml.safe_dump(params, sort_keys=False), changed


def stage_plan(root: Path) -> list[tuple[str, list[str]]]:
    """The stages of ``root``'s DAG in topological order (ties by name), each with the paths
    of its outputs (outs, metrics and plots), read by DVC's own API."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # an edge runs from a stage to a stage it depends on
        order = nx.lexicographical_topological_sort(graph.reverse(), key=lambda s: s.name)
        return [(s.name, [str(o.def_path) for o in s.outs]) for s in order]  # one dvc.yaml


def size_of(paths: list[Path]) -> tuple[int, int]:
    """Bytes and files under ``paths`` (files or folders; missing ones count nothing)."""
    total = files = 0
    for path in paths:
        if path.is_file():
            total, files = total + path.stat().st_size, files + 1
        for folder, _, names in os.walk(path):
            for name in names:
                total += os.lstat(os.path.join(folder, name)).st_size
                files += 1
    return total, files


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": version("torch"),
        "dvc": version("dvc"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# -- one run ---------------------------------------------------------------------------


def refresh_code(root: Path, outs: list[str]) -> list[str]:
    """The repository's files (those :func:`copy_project` copies) copied over ``root``'s
    where they differ, except its ``params.yaml``, ``dvc.lock`` and the stages' ``outs``
    (what a resumed run has made so far); the files that changed."""
    files = git(REPO, "ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    changed = []
    for rel in files:
        source, dest = REPO / rel, root / rel
        if rel in ("params.yaml", "dvc.lock") or any(Path(rel).is_relative_to(o) for o in outs):
            continue
        if source.is_file() and (not dest.is_file() or dest.read_bytes() != source.read_bytes()):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
            changed.append(rel)
    return changed


def run_dag(
    n_images: int,
    with_s3: bool,
    keep: bool,
    epochs: int | None = None,
    work: Path | None = None,
    again: tuple[str, ...] = (),
) -> dict:
    sys.path[:0] = [str(REPO / "tests")]
    from conftest import copy_project  # also sets the offline/no-analytics environment

    commit = {  # what the project was copied from (the repository may move on during a run)
        "git_commit": git(REPO, "rev-parse", "HEAD"),
        "git_dirty": bool(git(REPO, "status", "--porcelain", "--untracked-files=no")),
    }
    keep = keep or work is not None
    work = work or Path(tempfile.mkdtemp(prefix=f"vse-scale-{n_images}-"))
    work.mkdir(parents=True, exist_ok=True)
    held = FileLock(work / "run.lock")  # released when the run ends (or its process does)
    try:  # so a resumed run finds no other at work in the folder
        held.acquire(timeout=0)
    except Timeout:
        raise SystemExit(f"{work}: another scale run is working in this folder") from None
    root, logs, progress = work / "project", work / "logs", work / "stages.json"
    text, changed = scaled_params(n_images, epochs)
    hashes = work / "site-cache"  # DVC's hash database, here so it can be removed
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "DVC_NO_ANALYTICS": "1",
    }
    stages = {}
    if progress.is_file():  # a run resumed
        stages = {k: v for k, v in json.loads(progress.read_text()).items() if k not in again}
        if (root / "params.yaml").read_text() != text:
            raise SystemExit(f"{work}: its run is of other params; give another --work folder")
        outs = [o for _, stage_outs in stage_plan(root) for o in stage_outs]
        refreshed = refresh_code(root, outs)
        (root / ".dvc" / "tmp" / "rwlock").unlink(missing_ok=True)  # a killed run left it
        print(
            f"N={n_images}: resuming in {root}; {len(stages)} stages done, "
            f"{len(refreshed)} files of code refreshed",
            flush=True,
        )
    else:
        shutil.rmtree(root, ignore_errors=True)  # a run cut off before its first stage ended
        copy_project(REPO, root)
        (root / "params.yaml").write_text(text)
        logs.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["dvc", "config", "--local", "core.site_cache_dir", str(hashes)],
            cwd=root,
            env=env,
            check=True,
        )
        print(f"N={n_images}: project in {root}", flush=True)

    started = time.perf_counter()
    plan = stage_plan(root)
    for name, outs in plan:
        if name in stages:
            continue
        log = logs / f"{name.replace('@', '_')}.log"
        force = ["--force"] if name in again else []
        figures = measured(["dvc", "repro", "--single-item", *force, name], root, log, env)
        figures["out_bytes"], figures["out_files"] = size_of([root / o for o in outs])
        figures["ran"] = "didn't change" not in log.read_text()
        figures.update(git_commit=commit["git_commit"], cpu=machine()["cpu"])
        stages[name] = figures
        stages = {n: stages[n] for n, _ in plan if n in stages}  # in the DAG's order
        progress.write_text(json.dumps(stages, indent=2) + "\n")
        print(
            f"  {name:28} {figures['wall_s']:8.1f} s {n_images / figures['wall_s']:9.1f} images/s"
            f"  cpu {figures['cpu_s']:8.1f} s  peak {figures['peak_rss_mb']:7.0f} MB"
            f" (anon {figures['peak_anon_mb']:.0f}, mapped files {figures['peak_file_mb']:.0f})",
            flush=True,
        )
    dag_s = sum(s["wall_s"] for s in stages.values())

    log = logs / "dvc.log"
    dvc = {"status_s": measured(["dvc", "status"], root, log, env)["wall_s"]}
    shutil.rmtree(hashes)
    dvc["hash_commit_s"] = measured(["dvc", "commit", "--force"], root, log, env)["wall_s"]
    dvc["hashing"] = "dvc commit --force with the hash database (core.site_cache_dir) removed"
    dvc["cache_bytes"], dvc["cache_files"] = size_of([root / ".dvc" / "cache"])
    if with_s3:
        dvc.update(push_pull(root, work, env, log))
    overhead = dvc["status_s"] + dvc["hash_commit_s"]
    print(
        f"  dvc status {dvc['status_s']:.1f} s, hash+commit {dvc['hash_commit_s']:.1f} s: "
        f"{overhead / dag_s:.1%} of the DAG's {dag_s:.0f} s",
        flush=True,
    )

    result = {
        "images": n_images,
        "captions": n_images * yaml.safe_load(text)["demo"]["captions_per_image"],
        "params_changed": changed,
        "params_kept": "every other section of params.yaml, the models' sizes "
        + ("included" if epochs else "and epochs included")
        + "; the demo's image_size too (the detector, regions and grid "
        "resize every image to their own 128 px)",
        "stages": stages,
        "dag_s": round(dag_s, 3),
        "dvc": dvc,
        "overhead_share": round(overhead / dag_s, 4),
        "run_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
        **commit,
        "git_commits": sorted({s["git_commit"] for s in stages.values()}),
        "targets": TARGETS,
    }
    if keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)
    return result


def push_pull(root: Path, work: Path, env: dict, log: Path) -> dict:
    """``dvc push`` of the finished DAG to a local S3 endpoint, then ``dvc pull`` into a
    fresh git clone of the project (no cache, no outputs)."""
    from local_s3 import local_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    git(root, "add", "-A")
    git(root, "-c", "user.name=scale", "-c", "user.email=scale@localhost", "commit", "-qm", "dag")
    clone = work / "clone"
    git(work, "clone", "-q", str(root), str(clone))
    with local_s3("bucket") as options:
        for where in (root, clone):
            for args in (
                ["remote", "add", "--local", "-d", "local", "s3://bucket/path"],
                ["remote", "modify", "--local", "local", "endpointurl", options["endpoint_url"]],
                ["remote", "modify", "--local", "local", "access_key_id", options["key"]],
                ["remote", "modify", "--local", "local", "secret_access_key", options["secret"]],
                ["remote", "modify", "--local", "local", "region", "us-east-1"],
                ["config", "--local", "core.site_cache_dir", str(work / f"hashes-{where.name}")],
            ):
                subprocess.run(["dvc", *args], cwd=where, env=env, check=True)
        push = measured(["dvc", "push"], root, log, env)["wall_s"]
        pull = measured(["dvc", "pull"], clone, log, env)["wall_s"]
    status = subprocess.run(["dvc", "status"], cwd=clone, env=env, capture_output=True, text=True)
    return {
        "push_s": push,
        "pull_s": pull,
        "pulled_bytes": size_of([clone / ".dvc" / "cache"])[0],
        "pull_up_to_date": "up to date" in status.stdout,
    }


# -- the plot --------------------------------------------------------------------------


def fit(ns: list[int], values: list[float]) -> dict | None:
    """The least-squares line of log(value) on log(N): its slope (the exponent) and the
    value it projects at COCO's size; None with fewer than two sizes."""
    import numpy as np

    if len(set(ns)) < 2 or min(values) <= 0:
        return None
    slope, intercept = np.polyfit(np.log(ns), np.log(values), 1)
    return {"exponent": float(slope), "at_coco": float(np.exp(intercept) * COCO_IMAGES**slope)}


def linear_projections(runs: list[dict]) -> dict | None:
    """Each stage's marginal cost per image between the two largest runs (CPU and wall
    seconds), and its seconds at 40,000 images, COCO's and a web-sized set's, projected
    linearly from the largest run (fixed costs counted once: a projection of what a stage that
    scales linearly takes, next to the power law's); None with fewer than two sizes."""
    if len({r["images"] for r in runs}) < 2:
        return None
    small, large = runs[-2], runs[-1]
    extra = large["images"] - small["images"]
    out = {"between_images": [small["images"], large["images"]]}
    for name in [*large["stages"], "dag"]:
        if name != "dag" and name not in small["stages"]:
            continue
        row = {}
        for key, label in (("wall_s", "s"), ("cpu_s", "cpu_s")):
            per_image = (figure(large, name, key) - figure(small, name, key)) / extra
            row[f"{label}_per_1000_images"] = round(per_image * 1000, 2)
            for size, tag in ((40_000, "40k"), (COCO_IMAGES, "coco"), (WEB_IMAGES, "3m")):
                projected = figure(large, name, key) + per_image * (size - large["images"])
                row[f"{label}_at_{tag}_h"] = round(projected / 3600, 2)
        out[name] = row
    return out


def figure(run: dict, name: str, key: str) -> float:
    """A stage's ``key`` in a run; for the whole DAG ("dag"), its seconds, its stages' CPU
    seconds or their largest peak memory."""
    if name != "dag":
        return run["stages"][name][key]
    if key == "wall_s":
        return run["dag_s"]
    if key == "cpu_s":
        return sum(stage[key] for stage in run["stages"].values())
    return max(stage[key] for stage in run["stages"].values())


def plot(paths: list[Path], out_plot: Path, summary_path: Path) -> None:
    """One log-log plot of each stage's seconds against N, and ``summary.json``: each
    stage's exponents of time and peak RSS, their projections at COCO's size, the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["images"])
    settings = {
        json.dumps({k: v for k, v in r["params_changed"].items() if not k.startswith("demo.")})
        for r in runs
    }
    if len(settings) > 1:
        raise SystemExit(f"the runs differ in more than N (params_changed: {sorted(settings)})")
    in_range = [r for r in runs if FIT_RANGE[0] <= r["images"] <= FIT_RANGE[1]]
    fitted = in_range if len({r["images"] for r in in_range}) >= 2 else runs

    fig, ax = plt.subplots(figsize=(12, 7))
    colours = plt.get_cmap("tab20")
    fits = {}
    for i, name in enumerate([*runs[-1]["stages"], "dag"]):
        have = [r for r in runs if name == "dag" or name in r["stages"]]
        use = [r for r in fitted if r in have]
        time_fit = fit([r["images"] for r in use], [figure(r, name, "wall_s") for r in use])
        cpu_fit = fit([r["images"] for r in use], [figure(r, name, "cpu_s") for r in use])
        rss_fit = fit([r["images"] for r in use], [figure(r, name, "peak_rss_mb") for r in use])
        fits[name] = {
            "time_exponent": round(time_fit["exponent"], 3) if time_fit else None,
            "projected_s": round(time_fit["at_coco"], 1) if time_fit else None,
            "cpu_exponent": round(cpu_fit["exponent"], 3) if cpu_fit else None,
            "rss_exponent": round(rss_fit["exponent"], 3) if rss_fit else None,
            "projected_peak_rss_mb": round(rss_fit["at_coco"]) if rss_fit else None,
        }
        label = f"{name} (k={cpu_fit['exponent']:.2f})" if cpu_fit else name
        style = (
            {"color": "black", "linewidth": 3}
            if name == "dag"
            else {"color": colours(i % 20), "linestyle": "-" if i < 20 else "--"}
        )
        seconds = [figure(r, name, "cpu_s") for r in have]
        ax.plot([r["images"] for r in have], seconds, marker="o", label=label, **style)
    ax.set(xscale="log", yscale="log", xlabel="images (N)", ylabel="CPU seconds")
    epochs = runs[-1]["params_changed"].get("train.epochs")
    ax.set_title(
        "Each stage's CPU seconds (dvc repro --single-item) against N\n"
        f"(k: exponent fitted on N = {', '.join(format(r['images'], ',') for r in fitted)})"
        + (f"\ntraining stages at {epochs[1]} epoch(s) each" if epochs else "")
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines
    fig.tight_layout()
    out_plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_plot, dpi=120)

    stage_fits = [f for name, f in fits.items() if name != "dag"]
    exponents = [f["time_exponent"] for f in stage_fits if f["time_exponent"] is not None]
    projected_rss = [
        f["projected_peak_rss_mb"] for f in stage_fits if f["rss_exponent"] is not None
    ]
    at_40k = next((r for r in runs if r["images"] == 40_000), None)
    met = {
        "time_exponents": max(exponents) <= TARGETS["max_time_exponent"] if exponents else None,
        "peak_rss_at_40000": figure(at_40k, "dag", "peak_rss_mb")
        <= TARGETS["max_peak_rss_gb_at_40000"] * 1024
        if at_40k
        else None,
        "projected_peak_rss": max(projected_rss)
        <= TARGETS["max_projected_peak_rss_gb_at_coco"] * 1024
        if projected_rss
        else None,
        "overhead_share_at_40000": at_40k["overhead_share"]
        <= TARGETS["max_overhead_share_at_40000"]
        if at_40k
        else None,
    }
    linear = linear_projections(runs)
    summary = {
        "runs": [r["images"] for r in runs],
        "fitted_on_images": sorted({r["images"] for r in fitted}),
        "projected_to_images": COCO_IMAGES,
        "stages": fits,
        "linear": linear,
        "machines": machine_hours(runs[-1], linear),
        "targets": TARGETS,
        "met": met,  # null: no run at that size yet
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    table_path = summary_path.with_name("table.json")
    table_path.write_text(json.dumps(docs_table(runs, fits, linear), indent=2) + "\n")
    print(f"wrote {out_plot}, {summary_path} and {table_path}")


def docs_table(runs: list[dict], fits: dict, linear: dict | None) -> dict:
    """One row per stage (and the DAG) for the docs' table: seconds, peak RSS and (in runs
    that record it) peak anonymous memory at each N, the fitted exponents, and the linear
    projection's cost per 1,000 images and hours at COCO's and a web set's size."""
    table = {}
    for name in fits:
        row = {}
        for run in runs:
            if name == "dag" or name in run["stages"]:
                row[f"s_{run['images']}"] = round(figure(run, name, "wall_s"), 1)
                row[f"cpu_s_{run['images']}"] = round(figure(run, name, "cpu_s"), 1)
                row[f"peak_mb_{run['images']}"] = round(figure(run, name, "peak_rss_mb"))
                if "peak_anon_mb" in next(iter(run["stages"].values())):  # recorded since
                    row[f"anon_mb_{run['images']}"] = round(figure(run, name, "peak_anon_mb"))
        row["time_exponent"] = fits[name]["time_exponent"]
        row["cpu_exponent"] = fits[name]["cpu_exponent"]
        if linear and name in linear:
            row["cpu_s_per_1000_images"] = linear[name]["cpu_s_per_1000_images"]
            row["cpu_h_40000"] = linear[name]["cpu_s_at_40k_h"]
            row["coco_cpu_h"] = linear[name]["cpu_s_at_coco_h"]
            row["web_cpu_h"] = linear[name]["cpu_s_at_3m_h"]
            if name != "dag":
                times = epoch_factor(runs[-1], name)
                row["epochs_factor"] = round(times, 2)
                row["coco_cpu_h_own_epochs"] = round(row["coco_cpu_h"] * times, 2)
        table[name] = row
    if linear and "dag" in table:
        stages = [row for key, row in table.items() if key != "dag"]
        own = sum(row.get("coco_cpu_h_own_epochs", 0.0) for row in stages)
        table["dag"]["coco_cpu_h_own_epochs"] = round(own, 2)
    return table


def machine_hours(run: dict, linear: dict | None) -> dict | None:
    """Wall hours of the whole DAG at COCO's and a web set's size, every stage at its own
    epochs, on M machines like this one: the image stages (``SPREAD``, which a Dask
    cluster spreads) divided by M, every other stage on one machine. ``*_published``: with
    the published bottom-up-attention weights instead of the ``detector`` stage. From the
    linear projection of each stage's wall seconds; None with fewer than two sizes."""
    if not linear:
        return None
    out = {}
    for tag, images, key in (("coco", COCO_IMAGES, "coco"), ("web", WEB_IMAGES, "3m")):
        hours = {
            name: row[f"s_at_{key}_h"] * epoch_factor(run, name)
            for name, row in linear.items()
            if name not in ("dag", "between_images")
        }
        for skip, label in (((), tag), (("detector",), f"{tag}_published")):
            spread = sum(h for name, h in hours.items() if name in SPREAD)
            rest = sum(h for name, h in hours.items() if name not in (*SPREAD, *skip))
            row = {"images": images, "spread_h": round(spread, 1), "other_h": round(rest, 1)}
            out[label] = row | {f"on_{m}": round(spread / m + rest, 1) for m in MACHINES}
    return out


def epoch_factor(run: dict, stage: str) -> float:
    """How many times a stage's measured epochs its own setting in ``params.yaml`` is, for
    a run made with ``--epochs`` (1.0 for a stage that does not train, or a run without
    it): the whole stage's seconds times this over-counts only its fixed costs."""
    if stage in ("detector", "graph_rise"):
        section = stage
    elif stage.startswith(("train@", "train-ablation@")):
        section = "train"
    else:
        return 1.0
    own, measured = run["params_changed"].get(f"{section}.epochs", (1, 1))
    return own / measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, help="images in the demo dataset (N)")
    parser.add_argument("--out", type=Path, help="the run's JSON (default: results/scale/N.json)")
    parser.add_argument("--s3", action="store_true", help="also time dvc push and pull (moto)")
    parser.add_argument(
        "--epochs", type=int, help="every training stage trains this many epochs (default: its own)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp project")
    parser.add_argument(
        "--work", type=Path, help="run (or resume the run) in this folder, and keep it"
    )
    parser.add_argument(
        "--again",
        nargs="+",
        default=(),
        metavar="STAGE",
        help="with --work: measure these stages again (run by force), e.g. after a busy spell",
    )
    parser.add_argument("--plot", type=Path, nargs="+", help="runs' JSONs to plot")
    parser.add_argument("--out-plot", type=Path, default=RESULTS / "scale.png")
    parser.add_argument("--summary", type=Path, help="default: summary.json beside the plot")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the wrapper's log
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.measure:
        measure(args.command, args.measure)
    elif args.plot:
        plot(args.plot, args.out_plot, args.summary or args.out_plot.parent / "summary.json")
    elif args.images:
        result = run_dag(args.images, args.s3, args.keep, args.epochs, args.work, tuple(args.again))
        out = args.out or RESULTS / f"{args.images}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    else:
        parser.error("give --images N or --plot JSON...")


if __name__ == "__main__":
    main()
