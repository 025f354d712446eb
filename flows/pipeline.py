"""Prefect flows over the DVC DAG: one task per DVC stage, in the DAG's order.

Each task runs ``dvc repro --single-item <stage>`` (skipped when ``dvc status`` finds it up
to date), so DVC stays the single source of truth: ``dvc.lock`` and the cache are shared
with plain ``dvc repro``. The stage's output reaches the run's logs line by line.

Parameter overrides run as a DVC experiment in a temporary git worktree (uncommitted
changes copied in, DVC cache shared), recorded by ``dvc exp save``; the workspace's
params.yaml, dvc.lock and outputs are never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prefect import flow, get_run_logger, task

from infra.config import UserError

FEATURE_STAGES = ("regions", "grid", "global", "text", "scenegraph", "sbert_stats", "adversarial")
PROGRESS = re.compile(r"\d+%\|")  # a tqdm progress bar update
PROGRESS_EVERY = 10.0  # seconds between the progress lines sent to the logs


def dag_order(root: str | Path, targets: list[str] | None = None) -> list[str]:
    """Stage names, dependencies first; with ``targets``, only them and their upstream."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # edges point from a stage to the stages it needs
        order = [s.name for s in reversed(list(nx.topological_sort(graph)))]
        if targets is None:
            return order
        known = {s.name: s for s in graph.nodes}
        unknown = [t for t in targets if t not in known]
        if unknown:
            raise ValueError(f"unknown DVC stage(s) {unknown}; dvc.yaml has {sorted(known)}")
        wanted = set(targets)
        for t in targets:
            wanted |= {s.name for s in nx.descendants(graph, known[t])}
    return [s for s in order if s in wanted]


def _dvc(args: list[str], root: str | Path, what: str, env: dict | None = None) -> str:
    """Run a dvc command, stream its output into the run's logs line by line (progress
    bars every few seconds), fail with its last lines (never swallowed)."""
    logger = get_run_logger()
    proc = subprocess.Popen(
        ["dvc", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        encoding="utf-8",
        errors="replace",
    )
    lines: list[str] = []
    last_progress = 0.0
    for line in proc.stdout:  # universal newlines: a progress bar's "\r" ends a line too
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if PROGRESS.search(line):  # progress bars redraw many times a second
            if time.monotonic() - last_progress < PROGRESS_EVERY:
                continue
            last_progress = time.monotonic()
        else:
            lines.append(line)
        logger.info("%s | %s", what, line)
    if proc.wait():
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"{what} failed (dvc {' '.join(args)}, exit {proc.returncode}):\n{tail}")
    return "\n".join(lines)


def up_to_date(stage: str, root: str | Path) -> bool:
    """Whether DVC would skip ``stage`` (deps, params and outs as dvc.lock records them),
    from ``dvc status --json``."""
    result = subprocess.run(
        ["dvc", "status", "--json", stage], cwd=root, capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"dvc status {stage} failed: {result.stderr.strip()[-2000:]}")
    return not json.loads(result.stdout or "{}")


RESUME_FROM = "VSE_TRAIN_RESUME_FROM"  # a last.pt that `vse train` resumes from


def stage_metrics(root: str | Path, stage: str, metric: bool = True) -> list[Path]:
    """The metrics files a DVC stage writes (``metric``: else its other outputs), as
    ``dvc.yaml`` names them."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        for s in repo.index.stages:
            if s.addressing == stage or getattr(s, "name", None) == stage:
                return [Path(root) / str(o.def_path) for o in s.outs if bool(o.metric) == metric]
    raise ValueError(f"no DVC stage {stage!r} in {root}/dvc.yaml")


def resumable(last: Path, model: str, config: dict) -> bool:
    """Whether ``last`` is a ``last.pt`` of ``model`` trained with ``config`` (the params'
    ``models.<model>``), readable as plain data: what a rerun may resume from."""
    from infra.resume import read_checkpoint

    if not last.is_file():
        return False
    try:
        ckpt = read_checkpoint(last, needs=("model", "config", "state_dict", "optimizer"))
    except UserError:
        return False
    return ckpt["model"] == model and ckpt["config"] == config


def set_aside_preempted(root: str, stage: str) -> dict:
    """The environment that lets training stage ``stage`` resume (``{}`` if it cannot):
    ``dvc repro`` removes the ``last.pt`` a preempted run left, so a compatible one (same
    model and params) is copied aside and named to ``vse train`` by ``VSE_TRAIN_RESUME_FROM``
    (:func:`flows.commands.train.run_train`)."""
    from flows.params import load_params

    params = load_params(Path(root) / "params.yaml")
    run = stage.split("@", 1)[1]
    model = params.models.ablations[run].model if stage.startswith("train-ablation@") else run
    config = getattr(params.models, model).model_dump()
    for out in stage_metrics(root, stage, metric=False):
        last = out / "last.pt"
        if resumable(last, model, config):
            aside = Path(root) / ".dvc" / "tmp" / "vse-resume" / f"{run}.pt"
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(last, aside)
            get_run_logger().info("%s: resuming the preempted run from %s", run, last)
            return {RESUME_FROM: str(aside)}
    return {}


@task(retries=1, retry_delay_seconds=5, task_run_name="{stage}")
def run_stage(stage: str, root: str, env: dict | None = None, resume: bool = False) -> str:
    """One DVC stage: "skipped" when up to date, else "ran" (or restored from the run cache).
    ``env``: more environment for its command (e.g. its Dask cluster). With ``resume``, a
    training stage resumes from a preempted run's ``last.pt`` (:func:`set_aside_preempted`):
    on a rerun of the flow, and on this task's retry after the trainer exited 75."""
    if up_to_date(stage, root):
        get_run_logger().info("%s: up to date, skipped", stage)
        return "skipped"
    training = stage.startswith(("train@", "train-ablation@"))
    aside = set_aside_preempted(root, stage) if resume and training else {}
    try:
        _dvc(["repro", "--single-item", stage], root, stage, {**(env or {}), **aside})
    finally:
        if aside:  # used or not: a run preempted again leaves a newer last.pt
            Path(aside[RESUME_FROM]).unlink(missing_ok=True)
    return "ran"


def apply_overrides(params: Path, overrides: dict) -> None:
    """Set dotted keys (``models.mvvse.lambda_``) of ``params`` to JSON values (numbers,
    strings, null, lists), keeping its comments and layout; the result is validated as a
    whole, so a wrong key or value fails before any stage runs."""
    from flows.init import round_trip_yaml
    from flows.params import load_params

    yaml = round_trip_yaml()
    data = yaml.load(params.read_text(encoding="utf-8")) or {}
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    with params.open("w", encoding="utf-8") as f:
        yaml.dump(data, f)
    load_params(params)


@contextlib.contextmanager
def experiment_workspace(root: str | Path, overrides: dict) -> Iterator[Path]:
    """A temporary git worktree of ``root`` at HEAD with the workspace's uncommitted changes
    (what ``git status`` lists, ignored files aside), the DVC cache of ``root`` and the
    overrides in params.yaml; removed afterwards."""
    root = Path(root).resolve()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode:
        raise UserError(
            f"{root}: overrides run as a DVC experiment, which needs a git commit; commit "
            "the repository first (git add -A && git commit)"
        )
    work = Path(tempfile.mkdtemp(prefix="vse-experiment-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-q", str(work), "HEAD"], cwd=root, check=True
    )
    try:
        files = subprocess.run(
            ["git", "ls-files", "--modified", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        for rel in files:
            if (root / rel).is_file():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, work / rel)
        cache = subprocess.run(
            ["dvc", "cache", "dir"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        subprocess.run(["dvc", "cache", "dir", "--local", cache], cwd=work, check=True)
        apply_overrides(work / "params.yaml", overrides)
        yield work
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(work)], cwd=root)
        shutil.rmtree(work, ignore_errors=True)


@task(task_run_name="save experiment")
def save_experiment(work: str, stages: list[str], name: str, overrides: dict) -> str:
    """Record the experiment workspace's results as experiment ``name`` (``dvc exp save``,
    caching the outputs of ``stages``)."""
    message = "vse flow: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
    _dvc(["exp", "save", "--force", "-n", name, "-m", message, *stages], work, "experiment")
    get_run_logger().info("experiment %s: %s (see `dvc exp show`)", name, message)
    return name


def run_flow(
    name: str,
    targets: list[str] | None,
    root: str,
    overrides: dict | None,
    pull: bool,
    push: bool,
    remote: str | None,
    env: dict | None = None,
    collect: Callable[[Path, str | None], object] | None = None,
) -> dict[str, str]:
    """The stages of ``targets`` (all when None) and their upstream, one task each; with
    ``overrides``, as an experiment. ``collect(workspace, experiment)`` runs before the
    experiment's workspace goes (e.g. to read its metrics)."""
    remote_args = ["-r", remote] if remote else []
    if pull:
        _dvc(["pull", *remote_args, "--allow-missing"], root, "pull")
    stages = dag_order(root, targets)
    with (
        experiment_workspace(root, overrides) if overrides else contextlib.nullcontext(root)
    ) as work:
        # in DAG order; experiments (overrides) train afresh
        states = {stage: run_stage(stage, str(work), env, not overrides) for stage in stages}
        experiment = None
        if overrides:  # the same overrides name the same experiment (a rerun replaces it)
            digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()
            experiment = save_experiment(str(work), stages, f"{name}-{digest[:8]}", overrides)
        if collect is not None:
            collect(Path(work), experiment)
    if push:
        _dvc(["push", "--run-cache", *remote_args], root, "push")
    get_run_logger().info("stages: %s", states)
    return states


@flow(name="features")
def features_flow(
    root: str = ".",
    overrides: dict | None = None,
    pull: bool = False,
    push: bool = False,
    remote: str | None = None,
    dask_workers: int = 0,
    dask_address: str | None = None,
) -> dict[str, str]:
    """Every feature stage and what it needs (manifest, stores).

    With ``dask_workers`` (a local Dask cluster of that many processes) or ``dask_address``
    (a running cluster's scheduler), the image stages (regions, grid) extract their stores
    shard by shard over the cluster (:mod:`flows.distributed`), into the same stores.
    """
    present = set(dag_order(root))
    targets = [s for s in FEATURE_STAGES if s in present]
    env = {}
    if dask_workers:
        env["VSE_DASK_WORKERS"] = str(dask_workers)
    if dask_address:
        env["VSE_DASK_ADDRESS"] = dask_address
    return run_flow("features", targets, root, overrides, pull, push, remote, env)


@flow(name="pipeline")
def pipeline_flow(
    root: str = ".",
    overrides: dict | None = None,
    pull: bool = False,
    push: bool = False,
    remote: str | None = None,
) -> dict[str, str]:
    """The whole DAG."""
    return run_flow("pipeline", None, root, overrides, pull, push, remote)
