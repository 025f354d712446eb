"""Data-loading workers forked by a process in which Prefect runs (a flow run in-process, a
notebook, a test session): they inherit the thread-exit hooks of Prefect's services but
not their threads. Without :func:`infra.resume.init_worker` each worker ends with status 1
and no message when its epoch ends, and torch stops the run ("DataLoader worker exited
unexpectedly with exit code 1"); with it, the detector's loader and the image extraction
run as they do in a process without Prefect."""

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch
from demo_data import demo_manifest
from detector_data import TINY

import features.detector.loader
from features.detector.loader import make_loader
from features.images.config import GridConfig
from features.images.extract import extract_images
from features.images.grid import GridExtractor, build_trunk
from features.store.reader import Store
from features.store.spec import StoreConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM initialisation")


@pytest.fixture
def prefect_service():
    """Prefect's log service running in this process, as a flow's logging starts it: it
    registers a thread-exit hook, which forked children inherit."""
    from prefect.logging.handlers import APILogWorker

    APILogWorker.instance()
    yield
    APILogWorker.drain_all()


class Jobs(torch.utils.data.Dataset):
    """Each job is its own item."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, job):
        return job


def two_epochs(cfg, batches) -> list:
    return [list(make_loader(Jobs(), batches, cfg, seed=epoch)) for epoch in range(2)]


@pytest.mark.usefixtures("prefect_service")
def test_the_detectors_workers_end_their_epochs_after_prefect_ran(monkeypatch):
    cfg = TINY.model_copy(update={"num_workers": 2})
    batches = [[(i, False), (i + 1, True)] for i in range(0, 8, 2)]
    assert two_epochs(cfg, batches) == [batches, batches]
    # the control: workers that keep the inherited hooks fail as described above
    monkeypatch.setattr(features.detector.loader, "init_worker", lambda *_: None)
    with pytest.raises(RuntimeError, match="exited unexpectedly with exit code 1"):
        two_epochs(cfg, batches)


POOL = None


class Pooled(torch.utils.data.Dataset):
    """Each job runs on a thread pool the worker keeps open (as zarr keeps its own); an item
    is the worker's pid and the names of the thread-exit hooks it holds."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, job):
        global POOL
        POOL = POOL or ThreadPoolExecutor(1)
        POOL.submit(int).result()
        hooks = [getattr(h, "func", h).__qualname__ for h in threading._threading_atexits]
        return os.getpid(), hooks


@pytest.mark.usefixtures("prefect_service")
def test_a_worker_keeps_the_hook_that_stops_its_own_thread_pools():
    cfg = TINY.model_copy(update={"num_workers": 2})
    batches = list(make_loader(Pooled(), [[(i, False)] for i in range(4)], cfg, seed=0))
    pids = {pid for batch in batches for pid, _ in batch}
    hooks = {name for batch in batches for _, names in batch for name in names}
    # without concurrent.futures' hook, a worker's pool thread would keep it from exiting,
    # and it ignores the SIGTERM that torch sends a worker which does not end
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == []
    assert "_python_exit" in hooks and "_QueueServiceBase._at_exit" not in hooks


@pytest.mark.usefixtures("prefect_service")
def test_image_extraction_on_workers_after_prefect_ran_equals_one_process(tmp_path):
    root = tmp_path / "demo"
    manifest = demo_manifest(root, n_train=6, n_val=1, n_test=1, image_size=64)
    layout = StoreConfig(samples_per_shard=4, samples_per_chunk=2)
    stores = {}
    for workers in (0, 2):
        cfg = GridConfig(
            architecture="resnet18", image_size=64, grid=3, batch_size=2, num_workers=workers
        )
        extractor = GridExtractor(build_trunk(cfg), cfg, torch.device("cpu"))
        path = tmp_path / f"grid-{workers}.zarr"
        extract_images(extractor, manifest, root / "images", path, cfg, layout)
        stores[workers] = Store.open(path).read(0, 8)
    for name, values in stores[0].items():
        np.testing.assert_array_equal(stores[2][name], values, err_msg=name)
