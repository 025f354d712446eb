"""Prefect flows over the DVC DAG: one task per DVC stage, in the DAG's order.

DVC stays the single source of truth: each task runs ``dvc repro --single-item <stage>``
in the repository, so ``dvc.lock`` and the cache are shared with plain ``dvc repro`` (a
stage done by either is skipped by the other). Prefect adds retries, logs, run history
and, later, deployments. Parameter overrides run as one DVC experiment
(``dvc exp run -S key=value``), so every overridden run is recorded and reproducible.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from prefect import flow, get_run_logger, task

FEATURE_STAGES = ("regions", "grid", "global", "text", "scenegraph", "sbert_stats", "adversarial")


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
    """Run a dvc command, log its output, fail with its error (never swallowed)."""
    logger = get_run_logger()
    result = subprocess.run(
        ["dvc", *args], cwd=root, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    for line in (result.stdout + result.stderr).splitlines():
        if line.strip() and "it/s]" not in line and "/s]" not in line:
            logger.info("%s | %s", what, line)
    if result.returncode:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"{what} failed (dvc {' '.join(args)}, exit {result.returncode}):\n{tail}"
        )
    return result.stdout


@task(retries=1, retry_delay_seconds=5, task_run_name="{stage}")
def run_stage(stage: str, root: str, env: dict | None = None) -> str:
    """One DVC stage; DVC skips it when its deps, params and outs are unchanged. ``env``
    adds environment variables for the stage's command (e.g. its Dask cluster)."""
    out = _dvc(["repro", "--single-item", stage], root, stage, env)
    return "skipped" if "didn't change, skipping" in out else "ran"


@task(task_run_name="experiment")
def run_experiment(targets: list[str], overrides: dict, root: str, env: dict | None = None) -> str:
    """All ``targets`` as one DVC experiment with params overridden (``-S key=value``)."""
    sets = [arg for key, value in overrides.items() for arg in ("-S", f"{key}={value}")]
    return _dvc(["exp", "run", *sets, *targets], root, "experiment", env)


def _run(
    targets: list[str] | None,
    root: str,
    overrides: dict | None,
    pull: bool,
    push: bool,
    remote: str | None,
    env: dict | None = None,
) -> dict[str, str]:
    remote_args = ["-r", remote] if remote else []
    if pull:
        _dvc(["pull", *remote_args, "--allow-missing"], root, "pull")
    stages = dag_order(root, targets)
    if overrides:
        run_experiment(stages if targets else [], overrides, root, env)
        states = {s: "experiment" for s in stages}
    else:
        states = {}
        for stage in stages:  # in DAG order: each waits for the one before
            states[stage] = run_stage(stage, root, env)
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
    return _run(targets, root, overrides, pull, push, remote, env)


@flow(name="pipeline")
def pipeline_flow(
    root: str = ".",
    overrides: dict | None = None,
    pull: bool = False,
    push: bool = False,
    remote: str | None = None,
) -> dict[str, str]:
    """The whole DAG."""
    return _run(None, root, overrides, pull, push, remote)
