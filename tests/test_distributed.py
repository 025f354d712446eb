"""Distributed extraction: concurrent shard writers of one store, and a grid extraction
fanned out over a 2-worker Dask LocalCluster by Prefect, both ending identical to a
single-writer run."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from demo_data import demo_manifest

from features.images.config import GridConfig
from features.images.extract import extract_images
from features.images.grid import GridExtractor, build_trunk
from features.ingest.manifest import read_manifest
from features.store.layout import incomplete_path
from features.store.reader import Store
from features.store.spec import StoreConfig, StoreError
from features.store.writer import ShardWriter, StoreWriter

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402
from test_store import files_of  # noqa: E402

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM initialisation")

# A shard writer of the crash-test store: opens, says so, waits for "go", then commits
# its shards one by one (saying so), slowly enough to be killed in between.
SHARD_WRITER = """
import sys, time
import store_writer_job as job
from features.store.spec import StoreConfig
from features.store.writer import ShardWriter
path, shards = sys.argv[1], [int(k) for k in sys.argv[2].split(",")]
keys = [f"img{i:04d}" for i in range(120)]
cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
fields = job.fields_for("regions")
with ShardWriter(path, "regions", fields, keys, job.PROVENANCE, cfg, shards=shards) as w:
    print("open", flush=True)
    sys.stdin.readline()
    for shard in w.pending_shards():
        w.write_shard(shard, job.shard_data("regions", *w.shard_range(shard)))
        print(f"committed {shard}", flush=True)
        time.sleep(0.05)
"""


def start_shard_writer(path: Path, shards: list[int]) -> subprocess.Popen:
    tests, repo = Path(__file__).parent, Path(__file__).parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", SHARD_WRITER, str(path), ",".join(map(str, shards))],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [repo, tests, tests / "jobs"]))},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "open\n"
    return proc


def writer(path: Path, shards=None, kind="regions", n=120) -> StoreWriter:
    keys = [f"img{i:04d}" for i in range(n)]
    cfg = StoreConfig(samples_per_shard=8, samples_per_chunk=4)
    args = (path, kind, job.fields_for(kind), keys, job.PROVENANCE, cfg)
    return StoreWriter(*args) if shards is None else ShardWriter(*args, shards=shards)


def test_concurrent_shard_writers_give_the_single_writer_store(tmp_path):
    job.run(tmp_path / "single.zarr", "regions", 120, 8)
    target = tmp_path / "shared.zarr"
    with writer(target) as coordinator:  # creates the store; 15 shards pending
        assert coordinator.pending_shards() == list(range(15))
    evens = start_shard_writer(target, list(range(0, 15, 2)))
    odds = start_shard_writer(target, list(range(1, 15, 2)))
    # both hold their shards: a whole-store writer and an overlapping shard writer wait
    with pytest.raises(StoreError, match="locked by a running writer \\(shard writer pid"):
        writer(target).open()
    with pytest.raises(StoreError, match="shard 3 is being written by another shard writer"):
        writer(target, shards=[3, 4]).open()
    for proc in (evens, odds):
        proc.stdin.write("go\n")
        proc.stdin.flush()
    assert odds.stdout.readline() == "committed 1\n"
    odds.kill()  # a crashed worker: its committed shards stay, a rerun resumes the rest
    odds.wait()
    assert evens.wait() == 0
    building = incomplete_path(target)  # the store is built aside until finalized
    partial = Store.open(building, require_complete=False)
    assert partial.committed[0::2].all() and partial.committed[1] and not partial.committed.all()
    rerun = start_shard_writer(target, list(range(1, 15, 2)))
    rerun.communicate("go\n")
    assert rerun.returncode == 0
    assert not Store.open(building).attrs["complete"]  # shard writers never finalize
    assert not target.exists()
    with writer(target) as coordinator:  # finalizes, sweeps temp and lock files
        assert coordinator.pending_shards() == []
    assert files_of(target) == files_of(tmp_path / "single.zarr")
    assert Store.open(target).verify() == [] and not building.exists()


def test_shard_writers_refuse_ragged_missing_and_other_stores(tmp_path):
    with writer(tmp_path / "t.zarr", kind="tokens"):
        pass
    with pytest.raises(StoreError, match="ragged field\\(s\\) \\['features'\\] .* in order"):
        writer(tmp_path / "t.zarr", shards=[0], kind="tokens").open()
    with pytest.raises(StoreError, match="does not exist; create it first"):
        writer(tmp_path / "none.zarr", shards=[0]).open()
    with writer(tmp_path / "r.zarr", n=16):
        pass
    with pytest.raises(StoreError, match="made from other inputs .* never starts a store over"):
        writer(tmp_path / "r.zarr", shards=[0]).open()  # 120 samples, not 16
    with pytest.raises(StoreError, match="shard\\(s\\) \\[15\\] out of range"):
        writer(tmp_path / "r.zarr", shards=[15])
    with writer(tmp_path / "r2.zarr"):
        pass
    with writer(tmp_path / "r2.zarr", shards=[2]) as w:
        with pytest.raises(StoreError, match="shard 3 is not one of this shard writer's"):
            w.write_shard(3, job.shard_data("regions", 24, 32))
    r2 = incomplete_path(tmp_path / "r2.zarr")
    assert sorted(p.name for p in r2.iterdir() if p.name[0] == ".") == [
        ".lock",
        ".shard_locks",
    ]  # a shard writer leaves both to the next whole-store writer, which sweeps them
    with writer(tmp_path / "r2.zarr"):
        pass
    assert not [p for p in r2.iterdir() if p.name[0] == "."]


# --------------------------------------------------------------------------- Dask fan-out

LAYOUT = StoreConfig(samples_per_shard=4, samples_per_chunk=2)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # a loaded machine is slow
        yield


@pytest.fixture(scope="module")
def cluster(harness):
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as local:
        yield local


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A 12/4/4 demo dataset at 64px and its manifest: 20 images, 5 shards of 4."""
    root = tmp_path_factory.mktemp("demo")
    demo_manifest(root, n_train=12, n_val=4, n_test=4, image_size=64)
    return root


GRID = GridConfig(architecture="resnet18", image_size=64, grid=3, batch_size=2, num_workers=0)


def one_process_store(demo: Path, cfg: GridConfig, out: Path | str) -> None:
    """The grid store of the demo extracted in this process, with one torch thread as in
    each single-threaded Dask worker (and no loader workers)."""
    cfg = cfg.model_copy(update={"num_workers": 0})
    manifest = read_manifest(demo / "manifest.parquet")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extractor = GridExtractor(build_trunk(cfg), cfg, torch.device("cpu"))
        extract_images(extractor, manifest, demo / "images", out, cfg, LAYOUT)
    finally:
        torch.set_num_threads(threads)


def stop_mid_shard(claim: str, sig: int, remote: bool = False):
    """What :meth:`distributed.Client.run` installs in each worker: the first shard writer
    (of any worker) to write a shard's first field (local stores: holding the shard's
    lock; ``remote``: its first staged upload) writes its pid to ``claim`` and sends itself
    ``sig`` before the shard's commit."""

    def arm():
        import os

        from features.store.remote import RemoteStoreWriter
        from features.store.writer import ShardWriter

        def stop_once():
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            os.kill(os.getpid(), sig)

        if not remote:
            write = ShardWriter._write_dense

            def write_then_stop(self, *args, **kwargs):
                write(self, *args, **kwargs)
                stop_once()

            ShardWriter._write_dense = write_then_stop
            return
        stage = RemoteStoreWriter._claim

        def stage_then_stop(self, *args):
            put = self.fs.put_file

            def put_then_stop(*put_args, **kwargs):
                put(*put_args, **kwargs)
                stop_once()

            self.fs.put_file = put_then_stop
            try:
                stage(self, *args)
            finally:
                del self.fs.put_file

        RemoteStoreWriter._claim = stage_then_stop

    return arm


@contextlib.contextmanager
def nannyless_workers(n: int, env: dict, host: str | None = None, namespaces: dict | None = None):
    """A scheduler (on ``host``, else loopback) that drops a worker 3 s after its last
    heartbeat, and ``n`` worker processes without nannies (nothing restarts or stops a
    frozen one); worker i runs in network namespace ``namespaces[i] = (name, address)``
    if given. Yields the cluster, a client and the workers' processes."""
    import dask
    from distributed import Client, LocalCluster

    repo = Path(__file__).parent.parent
    env = {**os.environ, **env, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    with (
        dask.config.set({"distributed.scheduler.worker-ttl": "3s"}),
        LocalCluster(n_workers=0, host=host, dashboard_address=None) as local,
        Client(local.scheduler_address) as client,
    ):
        worker = [sys.executable, "-m", "dask", "worker", local.scheduler_address]
        worker += ["--no-nanny", "--nthreads", "1", "--no-dashboard"]
        workers = []
        for i in range(n):
            name, address = (namespaces or {}).get(i, (None, None))
            where = ["ip", "netns", "exec", name] if name else []
            listen = ["--host", address] if address else []
            workers.append(
                subprocess.Popen([*where, *worker, *listen], env=env, stderr=subprocess.DEVNULL)
            )
        try:
            client.wait_for_workers(n, timeout=120)
            yield local, client, workers
        finally:
            for proc in workers:
                proc.kill()
                proc.wait()


def test_grid_over_two_dask_workers_equals_one_process(demo, cluster, tmp_path):
    from flows.distributed import ExtractJob, run_distributed

    cfg = GRID.model_copy(update={"num_workers": 1})
    one_process_store(demo, cfg, tmp_path / "one.zarr")

    out = tmp_path / "dask.zarr"
    grid = ExtractJob.make("grid", demo / "manifest.parquet", demo / "images", out, cfg, LAYOUT)
    summary = run_distributed(grid, address=cluster.scheduler_address)
    assert summary["images"] == 20 and summary["shards"] == 5 and summary["samples"] == 20
    assert files_of(tmp_path / "dask.zarr") == files_of(tmp_path / "one.zarr")
    markers = Store.open(tmp_path / "dask.zarr").markers()
    assert all(m["files"] for m in markers)
    again = run_distributed(grid, address=cluster.scheduler_address)  # complete: no work
    assert again["shards"] == 0 and again["images"] == 0
    features = Store.open(tmp_path / "dask.zarr").read(0, 20)["features"]
    assert features.shape == (20, 3, 3, 512) and np.abs(features).sum() > 0  # ResNet-18 conv5


def test_the_image_stage_takes_its_dask_cluster_from_flags_or_environment(monkeypatch):
    """The features flow sets VSE_DASK_*; the stage's own arguments say where its data is."""
    from flows.cli import build_parser
    from flows.commands.extract_images import dask_settings
    from infra.config import UserError

    argv = ["extract", "grid", "--manifest", "m", "--images", "i", "--out", "o"]
    argv += ["--errors", "e", "--metrics", "j"]
    args = build_parser().parse_args(argv)
    monkeypatch.delenv("VSE_DASK_WORKERS", raising=False)
    monkeypatch.delenv("VSE_DASK_ADDRESS", raising=False)
    assert dask_settings(args) == (0, None)
    monkeypatch.setenv("VSE_DASK_WORKERS", "3")
    assert dask_settings(args) == (3, None)
    assert dask_settings(build_parser().parse_args([*argv, "--dask-workers", "2"])) == (2, None)
    monkeypatch.setenv("VSE_DASK_WORKERS", "many")
    with pytest.raises(UserError, match="VSE_DASK_WORKERS='many'"):
        dask_settings(args)
    monkeypatch.setenv("VSE_DASK_WORKERS", "2")
    monkeypatch.setenv("VSE_DASK_ADDRESS", "tcp://h:8786")
    with pytest.raises(UserError, match="not both"):
        dask_settings(args)


def test_a_worker_killed_in_the_middle_of_a_shard_costs_no_manual_step(demo, tmp_path):
    """Three Dask workers; the first to write a shard's first field is SIGKILLed before the
    shard's commit marker, holding the shard's lock and leaving half a shard. Dask sends the
    task to another worker, whose shard writer takes the dead writer's lock (an ``flock``
    dies with its process) and rewrites the shard: the store equals one process's, byte for
    byte, and verifies."""
    from distributed import LocalCluster

    from flows.distributed import ExtractJob, run_distributed

    cfg = GRID  # the one-process store and the Dask run extract alike
    one_process_store(demo, cfg, tmp_path / "one.zarr")
    claim = tmp_path / "killed"  # made by the one worker that dies, so only one dies

    out = tmp_path / "dask.zarr"
    grid = ExtractJob.make("grid", demo / "manifest.parquet", demo / "images", out, cfg, LAYOUT)
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None
        ) as local,
        local.get_client() as client,
    ):
        # in every worker process; a restarted worker is not armed
        client.run(stop_mid_shard(str(claim), signal.SIGKILL))
        summary = run_distributed(grid, address=local.scheduler_address)
    assert claim.exists()  # a worker did die in the middle of a shard
    assert summary["shards"] == 5 and summary["samples"] == 20
    assert files_of(out) == files_of(tmp_path / "one.zarr")
    assert Store.open(out).verify() == [] and not incomplete_path(out).exists()


def test_a_frozen_worker_whose_task_moved_on_never_mixes_a_shard(demo, tmp_path):
    """A zombie writer: three workers without nannies (nothing can stop a frozen one); the
    first to write a shard's first field freezes (SIGSTOP) holding the shard's lock. It
    misses its heartbeats, the scheduler drops it and gives its task to another worker,
    whose shard writer is refused the locked shard (its retry too), so the run fails in one
    line naming the shard. The zombie then wakes (SIGCONT) and finishes its shard or closes;
    either way no shard is mixed and the rerun completes the store equal to one process's,
    byte for byte. (One machine: the freeze stands in for a cut network; an ``flock``
    guards a store on one file system only.)"""
    import threading

    from flows.distributed import ExtractJob, run_distributed

    cfg = GRID  # the one-process store and the Dask run extract alike
    one_process_store(demo, cfg, tmp_path / "one.zarr")
    claim = tmp_path / "frozen"  # the frozen worker's pid

    out = tmp_path / "dask.zarr"
    grid = ExtractJob.make("grid", demo / "manifest.parquet", demo / "images", out, cfg, LAYOUT)
    outcome = {}

    def first_run(address):
        try:
            outcome["summary"] = run_distributed(grid, address=address)
        except Exception as err:
            outcome["error"] = err

    with nannyless_workers(3, {}) as (local, client, workers):
        client.run(stop_mid_shard(str(claim), signal.SIGSTOP))
        run = threading.Thread(target=first_run, args=(local.scheduler_address,))
        run.start()
        run.join(timeout=240)
        assert not run.is_alive() and claim.exists()
        zombie = int(claim.read_text())
        os.kill(zombie, signal.SIGCONT)
        frozen = next(proc for proc in workers if proc.pid == zombie)
        message = str(outcome["error"])  # the moved task was refused the zombie's shard
        assert "\n" not in message and "is being written by another shard writer" in message
        for _ in range(600):  # the zombie finishes its shard or closes, releasing its lock
            building = Store.open(incomplete_path(out), require_complete=False)
            if building.committed.all() or frozen.poll() is not None:
                break
            time.sleep(0.1)
        again = run_distributed(grid, address=local.scheduler_address)
    assert again["shards"] <= 1  # the zombie's shard, unless it finished it itself
    assert files_of(out) == files_of(tmp_path / "one.zarr")
    assert Store.open(out).verify() == [] and not incomplete_path(out).exists()


def test_a_store_on_s3_survives_a_zombie_worker_with_no_manual_step(demo, tmp_path, monkeypatch):
    """The same zombie, writing a store to S3 (moto on loopback) with no lock: the first
    committed copy of each shard wins (a conditional PUT), so the moved task commits the
    zombie's shard and the run completes. The zombie, woken after finalization, commits its
    copy into its own staging only; the store stays equal to one process's local store,
    byte for byte, and the next run keeps it and deletes the zombie's leftovers."""
    import threading

    import s3fs
    from local_s3 import local_s3

    from features.store.integrity import verify_store
    from flows.distributed import ExtractJob, run_distributed

    one_process_store(demo, GRID, tmp_path / "one.zarr")
    claim = tmp_path / "frozen"
    url = "s3://stores/grid.zarr"
    grid = ExtractJob.make("grid", demo / "manifest.parquet", demo / "images", url, GRID, LAYOUT)
    with local_s3("stores") as options:
        env = {
            "AWS_ENDPOINT_URL": options["endpoint_url"],
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        fs = s3fs.S3FileSystem(**options)
        local_files = files_of(tmp_path / "one.zarr")
        one_process_store(demo, GRID, "s3://stores/one.zarr")  # one writer, straight to S3
        uploaded = {p: fs.cat_file(p) for p in sorted(fs.find("stores/one.zarr"))}
        assert {p.removeprefix("stores/one.zarr/"): b for p, b in uploaded.items()} == local_files
        with nannyless_workers(3, env) as (local, client, workers):
            client.run(stop_mid_shard(str(claim), signal.SIGSTOP, remote=True))
            outcome = {}
            run = threading.Thread(
                target=lambda: outcome.update(
                    run_distributed(grid, address=local.scheduler_address)
                )
            )
            run.start()
            run.join(timeout=240)
            assert not run.is_alive() and claim.exists()  # completed with a worker frozen
            assert outcome["shards"] == 5 and outcome["samples"] == 20
            store = {p: fs.cat_file(p) for p in sorted(fs.find("stores/grid.zarr"))}
            assert {p.removeprefix("stores/grid.zarr/"): b for p, b in store.items()} == local_files
            assert verify_store(url, options) == []
            os.kill(int(claim.read_text()), signal.SIGCONT)
            for _ in range(600):  # the zombie commits its copy: into its own staging only
                fs.invalidate_cache()
                if fs.exists("stores/grid.zarr.incomplete/_claims"):
                    break
                time.sleep(0.1)
            again = run_distributed(grid, address=local.scheduler_address)
        assert again["shards"] == 0  # complete: kept
        fs.invalidate_cache()
        assert {p: fs.cat_file(p) for p in sorted(fs.find("stores/grid.zarr"))} == store
        assert not fs.exists("stores/grid.zarr.incomplete")


# ------------------------------------------------------------------ a machine cut off


@contextlib.contextmanager
def network_namespace(name: str, host: str, inside: str):
    """A network namespace ``name`` (a machine of its own on the network) joined to this
    one by a veth pair: this side ``host``, the namespace's side ``inside`` (a /30).
    Yields this side's interface: ``ip link set IF down`` cuts the namespace off,
    ``up`` reconnects it. Needs root (CI and this project's machines run as root)."""
    here, there = f"{name[:10]}-h", f"{name[:10]}-n"

    def ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"

    subprocess.run(["ip", "netns", "del", name], capture_output=True)  # a killed run's
    subprocess.run(["ip", "link", "del", here], capture_output=True)
    ip("netns", "add", name)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"{host}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{inside}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield here
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # and its veth end
        subprocess.run(["ip", "link", "del", here], capture_output=True)


@contextlib.contextmanager
def forwarded(port: int, host: str):
    """A TCP forwarder from ``host``:(a free port) to 127.0.0.1:``port``: a server that
    listens on loopback only (Prefect's temporary API) made reachable from a namespace.
    Yields the forwarder's port."""
    import socket
    import socketserver
    import threading

    def pump(source, sink) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    class Pipe(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with socket.create_connection(("127.0.0.1", port)) as upstream:
                back = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
                back.start()
                pump(self.request, upstream)
                back.join()

    server = socketserver.ThreadingTCPServer((host, 0), Pipe)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def cut_mid_shard(claim: str, cut: str):
    """What :meth:`distributed.Client.run` installs in the worker to be cut off: after its
    first staged upload of a shard, it writes its pid to ``claim`` and waits (up to a
    minute) until ``cut`` exists, the test having cut its network meanwhile; then it goes
    on to claim the shard, over a network that is gone."""

    def arm():
        import os
        import time

        from features.store.remote import RemoteStoreWriter

        stage = RemoteStoreWriter._claim

        def stage_then_wait(self, *args):
            put = self.fs.put_file

            def put_then_wait(*put_args, **kwargs):
                put(*put_args, **kwargs)
                if os.path.exists(claim):
                    return
                with open(claim, "w") as f:
                    f.write(str(os.getpid()))
                for _ in range(600):
                    if os.path.exists(cut):
                        return
                    time.sleep(0.1)

            self.fs.put_file = put_then_wait
            try:
                stage(self, *args)
            finally:
                del self.fs.put_file

        RemoteStoreWriter._claim = stage_then_wait

    return arm


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2's ip for network namespaces (CI runs as root)",
)
def test_a_worker_cut_off_the_network_mid_shard_loses_it_to_the_moved_task(
    demo, tmp_path, monkeypatch
):
    """Three Dask workers write a store to S3; one runs on a machine of its own (a network
    namespace, joined by a veth pair to the scheduler's and the S3 endpoint's). After its
    first staged upload its network is cut: the scheduler drops it after its heartbeats
    stop and gives its task to another worker, and the run completes with no manual step,
    the store equal to one process's local store byte for byte. The network is then
    restored and the cut-off worker, a zombie, goes on with its write: it can only lose
    (its claim comes after the moved task's, or after the store was finalized), the store
    stays as it was, and the next run keeps it and deletes the zombie's leftovers."""
    import contextvars
    import threading

    import s3fs
    from local_s3 import local_s3
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from features.store.integrity import verify_store
    from flows.distributed import ExtractJob, run_distributed

    one_process_store(demo, GRID, tmp_path / "one.zarr")
    local_files = files_of(tmp_path / "one.zarr")
    claim, cut = tmp_path / "cut-off", tmp_path / "network-cut"
    url = "s3://stores/grid.zarr"
    grid = ExtractJob.make("grid", demo / "manifest.parquet", demo / "images", url, GRID, LAYOUT)
    pid = os.getpid()  # a namespace and subnet of this run's own
    namespace, subnet = f"vse{pid}", f"10.{200 + pid % 50}.{pid // 50 % 256}"
    host, inside = f"{subnet}.1", f"{subnet}.2"
    api = SubprocessASGIServer()  # Prefect's temporary API, on loopback
    api.start()
    with (
        network_namespace(namespace, host, inside) as link,
        local_s3("stores", host=host) as options,
        forwarded(api.port, host) as api_port,
        temporary_settings(updates={PREFECT_API_URL: f"http://{host}:{api_port}/api"}),
    ):
        env = {
            "AWS_ENDPOINT_URL": options["endpoint_url"],
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "PREFECT_API_URL": f"http://{host}:{api_port}/api",  # every machine's API
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        fs = s3fs.S3FileSystem(**options)
        with nannyless_workers(3, env, host=host, namespaces={0: (namespace, inside)}) as (
            local,
            client,
            workers,
        ):
            remote = [a for a in client.scheduler_info()["workers"] if f"//{inside}:" in a]
            assert len(remote) == 1, client.scheduler_info()["workers"].keys()
            client.run(cut_mid_shard(str(claim), str(cut)), workers=remote)
            outcome = {}
            run = threading.Thread(  # in this context: Prefect's settings are context vars
                target=contextvars.copy_context().run,
                args=(
                    lambda: outcome.update(run_distributed(grid, address=local.scheduler_address)),
                ),
            )
            run.start()
            for _ in range(1200):
                if claim.exists() or not run.is_alive():
                    break
                time.sleep(0.1)
            assert claim.exists(), "the worker in the namespace staged no shard"
            subprocess.run(["ip", "link", "set", link, "down"], check=True)
            cut.touch()
            run.join(timeout=240)
            assert not run.is_alive(), "the run did not complete with a worker cut off"
            assert outcome["shards"] == 5 and outcome["samples"] == 20
            store = {p: fs.cat_file(p) for p in sorted(fs.find("stores/grid.zarr"))}
            assert {p.removeprefix("stores/grid.zarr/"): b for p, b in store.items()} == local_files
            assert verify_store(url, options) == []
            subprocess.run(["ip", "link", "set", link, "up"], check=True)
            for _ in range(900):  # reconnected, the zombie finishes its write: its claim
                fs.invalidate_cache()  # lands in a staging that belongs to no store
                if fs.exists("stores/grid.zarr.incomplete/_claims"):
                    break
                time.sleep(0.1)
            assert fs.exists("stores/grid.zarr.incomplete/_claims"), "the zombie never wrote"
            late = [
                json.loads(fs.cat_file(p)) for p in fs.ls("stores/grid.zarr.incomplete/_claims")
            ]
            assert [c["writer"].split("-")[-2] for c in late] == [claim.read_text()]
            assert {p: fs.cat_file(p) for p in sorted(fs.find("stores/grid.zarr"))} == store
            again = run_distributed(grid, address=local.scheduler_address)
        assert again["shards"] == 0  # complete: kept
        fs.invalidate_cache()
        assert {p: fs.cat_file(p) for p in sorted(fs.find("stores/grid.zarr"))} == store
        assert not fs.exists("stores/grid.zarr.incomplete")
        # send Prefect's queued logs and events while the forwarder is there (left queued,
        # the next drain would retry them against a closed port for minutes)
        APILogWorker.drain_all()
        EventsWorker.drain_all()
