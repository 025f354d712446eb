"""Prefect flows over the DVC DAG: one task per DVC stage, in the DAG's order.

DVC stays the single source of truth: each task runs ``dvc repro --single-item <stage>``
in the repository, so ``dvc.lock`` and the cache are shared with plain ``dvc repro`` (a
stage done by either is skipped by the other). Prefect adds retries, logs, run history
and, later, deployments. Parameter overrides run as one DVC experiment
(``dvc exp run -S key=value``), so every overridden run is recorded and reproducible.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows.distributed import DaskFanOut

FEATURE_STAGES = (
    "regions",
    "grid",
    "global",
    "text",
    "scenegraph",
    "sbert_stats",
    "shards",
    "adversarial",
)


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


def _dvc(args: list[str], root: str | Path, what: str) -> str:
    """Run a dvc command, log its output, fail with its error (never swallowed)."""
    logger = get_run_logger()
    result = subprocess.run(["dvc", *args], cwd=root, capture_output=True, text=True)
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
def run_stage(stage: str, root: str) -> str:
    """One DVC stage; DVC skips it when its deps, params and outs are unchanged."""
    out = _dvc(["repro", "--single-item", stage], root, stage)
    return "skipped" if "didn't change, skipping" in out else "ran"


@task(task_run_name="experiment")
def run_experiment(targets: list[str], overrides: dict, root: str) -> str:
    """All ``targets`` as one DVC experiment with params overridden (``-S key=value``)."""
    sets = [arg for key, value in overrides.items() for arg in ("-S", f"{key}={value}")]
    return _dvc(["exp", "run", *sets, *targets], root, "experiment")


def _run(
    targets: list[str] | None,
    root: str,
    overrides: dict | None,
    pull: bool,
    push: bool,
    remote: str | None,
    before_stage: Callable[[str], object] | None = None,
) -> dict[str, str]:
    remote_args = ["-r", remote] if remote else []
    if pull:
        _dvc(["pull", *remote_args, "--allow-missing"], root, "pull")
    stages = dag_order(root, targets)
    if overrides:
        run_experiment(stages if targets else [], overrides, root)
        states = {s: "experiment" for s in stages}
    else:
        states = {}
        for stage in stages:  # in DAG order: each waits for the one before
            if before_stage is not None:
                before_stage(stage)
            states[stage] = run_stage(stage, root)
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
    """Every feature stage and what it needs (manifest, stores, shards).

    With ``dask_workers`` (a local Dask cluster of that many processes) or ``dask_address``
    (a running cluster's scheduler), the stores of the image stages (regions, grid) are
    first filled shard by shard over the cluster (:mod:`flows.distributed`); DVC then runs
    the stages as usual, finds every shard committed, and records them in dvc.lock.
    """
    present = set(dag_order(root))
    targets = [s for s in FEATURE_STAGES if s in present]
    with DaskFanOut(root, dask_workers, dask_address) as fan_out:
        if fan_out.enabled and overrides:
            raise ValueError(
                "a Dask fan-out fills stores from params.yaml, but overrides run as a DVC "
                "experiment; drop dask_workers/dask_address or the overrides"
            )
        hook = fan_out if fan_out.enabled else None
        return _run(targets, root, overrides, pull, push, remote, before_stage=hook)


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
