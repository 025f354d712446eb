"""Distributed image extraction: the shards of a store fanned out over a Dask cluster by
Prefect's Dask task runner (prefect-dask); ``docs/tutorials/dask-cluster.md`` shows how.

The flow plans (creates or resumes the store), runs one task per group of pending shards
(a shard writer committing exactly its own shards, with the extractor built once per
worker process, never pickled) and finalizes once every shard is committed. A shard's
content depends only on its images, so the store is bitwise identical to a one-process
run's when batches start at shard boundaries (``samples_per_shard`` a multiple of
``batch_size``) and both use the same number of torch threads (Dask's nanny starts
workers with ``OMP_NUM_THREADS=1``). Workers must see the coordinator's paths.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from pydantic import BaseModel, ConfigDict

from features.images.config import ExtractConfig, GridConfig, RegionsConfig
from features.store.reader import Store
from features.store.spec import StoreConfig, StoreError
from infra.config import require_extra
from infra.files import is_url, location


class ExtractJob(BaseModel):
    """One image stage's extraction as data that travels to every worker: absolute paths,
    the stage's typed params section and the store layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["regions", "grid"]
    manifest: str
    images: str
    out: str
    config: RegionsConfig | GridConfig
    store: StoreConfig = StoreConfig()

    @property
    def store_location(self) -> Path | str:
        """The store: a local path, or an fsspec URL as given (``s3://...``)."""
        return location(self.out)

    @classmethod
    def make(cls, stage, manifest, images, out, cfg: ExtractConfig, store: StoreConfig):
        return cls(
            stage=stage,
            manifest=str(Path(manifest).resolve()),
            images=str(Path(images).resolve()),
            out=str(out) if is_url(out) else str(Path(out).resolve()),
            config=cfg,
            store=store,
        )


# --------------------------------------------------------------------------- worker side

_EXTRACTORS: dict[str, Any] = {}  # per worker process: the last extractor built, by config


def worker_extractor(job: ExtractJob):
    """The job's extractor, built in this (worker) process on first use and kept, so the
    tasks of a job that land on the same worker share one model."""
    key = job.config.model_dump_json() + job.stage
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        from features.images.extract import build_image_extractor

        with warnings.catch_warnings():
            warnings.simplefilter("always")  # a random-init warning in every worker's log
            _EXTRACTORS[key] = build_image_extractor(job.stage, job.config)
    return _EXTRACTORS[key]


def _store_writer(job: ExtractJob):
    """The store's one whole-store writer (it creates or resumes the store)."""
    from features.images.extract import image_store_writer
    from features.ingest.manifest import read_manifest

    manifest = read_manifest(Path(job.manifest))
    log = get_run_logger().info
    return image_store_writer(
        worker_extractor(job), manifest, job.store_location, job.config, job.store, log=log
    )


@task(task_run_name="plan {job.stage}")
def plan_store(job: ExtractJob) -> list[int]:
    """Create or resume the store; its pending shards."""
    with _store_writer(job) as writer:
        return writer.pending_shards()


def _group_name(parameters: dict) -> str:
    shards = parameters["shards"]
    return f"{parameters['job'].stage} shards {shards[0]}-{shards[-1]}"


@task(task_run_name=_group_name, retries=1, retry_delay_seconds=5)
def extract_shards(job: ExtractJob, shards: list[int]) -> dict:
    """Extract and commit ``shards`` of the store (a shard writer); timing of the group.
    A retry resumes: shards committed before a failure are skipped."""
    from features.images.extract import extract_images
    from features.ingest.manifest import read_manifest

    logger = get_run_logger()
    cfg = job.config
    if cfg.num_workers and multiprocessing.current_process().daemon:
        logger.info("daemonic Dask worker: images decoded in the task (num_workers 0)")
        cfg = cfg.model_copy(update={"num_workers": 0})  # a daemon cannot have children
    timing = extract_images(
        worker_extractor(job),
        read_manifest(Path(job.manifest)),
        Path(job.images),
        job.store_location,
        cfg,
        job.store,
        log=logger.info,
        shards=shards,
    )
    logger.info("%s shards %s: %s", job.stage, shards, timing.summary())
    phases = ("images", "seconds", "read", "infer", "write")
    return {"shards": len(shards), **{k: getattr(timing, k) for k in phases}}


@task(task_run_name="finalize {job.stage}")
def finalize_store(job: ExtractJob) -> dict:
    """Open the store whole once every shard writer is done: it is finalized (and its
    temp and lock files swept) if every shard is committed; an error naming the
    missing shards otherwise."""
    with _store_writer(job) as writer:
        missing = writer.pending_shards()
    if missing:
        raise StoreError(
            f"store {job.out}: shard(s) {missing} are still not committed after the fan-out; "
            "rerun to extract them (committed shards are kept)"
        )
    store = Store.open(job.out)
    return {"samples": len(store), "bad_images": len(store.notes())}


# --------------------------------------------------------------------------- coordinator


@flow(name="extract-distributed", flow_run_name="extract-{job.stage}")
def extract_distributed(job: ExtractJob, shards_per_task: int = 1) -> dict:
    """Fill the job's store over the flow's Dask task runner: plan, one task per group of
    ``shards_per_task`` pending shards, finalize. Returns counts and throughput."""
    logger = get_run_logger()
    if shards_per_task < 1:
        raise ValueError(f"shards_per_task must be >= 1, got {shards_per_task}")
    cfg = job.config
    if job.store.samples_per_shard % cfg.batch_size:
        logger.warning(
            "%s.batch_size %d does not divide store.samples_per_shard %d: batches straddle "
            "shards differently than in a single-process run, whose features may then differ "
            "in the last bits",
            job.stage,
            cfg.batch_size,
            job.store.samples_per_shard,
        )
    start = time.perf_counter()
    pending = plan_store.submit(job).result()
    summary = {"stage": job.stage, "store": job.out, "shards": len(pending), "images": 0}
    if not pending:
        logger.info("%s: every shard of %s is committed; nothing to extract", job.stage, job.out)
        return summary
    groups = [pending[i : i + shards_per_task] for i in range(0, len(pending), shards_per_task)]
    logger.info(
        "%s: %d pending shard(s) of %s in %d task(s) over the Dask cluster",
        job.stage,
        len(pending),
        job.out,
        len(groups),
    )
    futures = [extract_shards.submit(job, group) for group in groups]
    results, failed = [], []
    for group, future in zip(groups, futures, strict=True):
        try:
            results.append(future.result())
        except Exception as err:  # wait for every group before failing: keep their commits
            failed.append(f"shards {group}: {type(err).__name__}: {err}")
    if failed:
        raise StoreError(
            f"{job.stage}: {len(failed)} of {len(groups)} task(s) failed; committed shards "
            f"are kept, rerun to resume. " + " | ".join(failed[:5])
        )
    summary.update(finalize_store.submit(job).result())
    seconds = time.perf_counter() - start
    images = sum(r["images"] for r in results)
    summary.update(
        images=images,
        seconds=round(seconds, 2),
        images_per_s=round(images / max(seconds, 1e-9), 2),
        shards_per_s=round(len(pending) / max(seconds, 1e-9), 3),
        task_seconds={k: round(sum(r[k] for r in results), 2) for k in ("read", "infer", "write")},
    )
    logger.info(
        "%s: %d images in %d shard(s) in %.1f s (%.1f img/s, %.2f shards/s over %d task(s)); "
        "summed over tasks: read %.1f s, infer %.1f s, write %.1f s",
        job.stage,
        images,
        len(pending),
        seconds,
        summary["images_per_s"],
        summary["shards_per_s"],
        len(groups),
        *summary["task_seconds"].values(),
    )
    return summary


def _shared_prefect_api():
    """Settings that send the workers' task runs to this process's Prefect API: without
    ``PREFECT_API_URL``, every Dask worker would start a temporary server of its own
    (10-20 s each) and record its task runs there."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return contextlib.nullcontext()
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the one Prefect itself uses in this process
    server.start()
    return temporary_settings(updates={PREFECT_API_URL: server.api_url})


def run_distributed(
    job: ExtractJob, workers: int = 0, address: str | None = None, shards_per_task: int = 1
) -> dict:
    """Run :func:`extract_distributed` with Prefect's Dask task runner on the cluster at
    ``address``, or on a LocalCluster of ``workers`` single-threaded processes that lives
    as long as the flow run."""
    require_extra("distributed", "dask", "extraction over a Dask cluster")
    dask = require_extra("prefect_dask", "dask", "extraction over a Dask cluster")
    if address:
        runner = dask.DaskTaskRunner(address=address)
    elif workers < 1:
        raise ValueError(f"a local Dask cluster needs workers >= 1, got {workers}")
    else:
        runner = dask.DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True},
        )
    with _shared_prefect_api():
        return extract_distributed.with_options(task_runner=runner)(
            job=job, shards_per_task=shards_per_task
        )
