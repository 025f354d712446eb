"""Shared test setup: offline, no analytics, small fixtures generated in code."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from strict_skips import pytest_collection_modifyitems, pytest_configure  # noqa: F401

# pytester: tests/test_strict_skips.py runs pytest sessions of its own
pytest_plugins = ["pytester", "mutation_speed"]

os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The `vse` and `dvc` executables next to this interpreter, even if the venv is not activated.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

REPO = Path(__file__).resolve().parent.parent
# the project's tools (tools/: dag_deps, mutation, make_butd_golden) and the tests' subprocess
# jobs (tests/jobs/), importable by the tests
sys.path[:0] = [str(REPO / "tools"), str(REPO / "tests" / "jobs")]

# A run's tmp folders peak at about 3 GB (torchvision checkpoints, copies of the demo); pytest
# removes them as it goes (pyproject.toml: tmp_path_retention_policy).
NEEDS_GB = 4


def pytest_sessionstart(session):
    """One clear line instead of hundreds of 'No space left on device' errors."""
    where = Path(session.config.option.basetemp or tempfile.gettempdir())
    where = next(p for p in (where, *where.parents) if p.exists())
    free = shutil.disk_usage(where).free / 1e9
    if free < NEEDS_GB:
        pytest.exit(
            f"tests: {free:.1f} GB free under {where}, and a run needs about {NEEDS_GB} GB: "
            "free some space there (old pytest-of-* folders, say) or pass --basetemp DIR "
            "on a larger disk",
            returncode=1,
        )


@pytest.fixture
def one_thread():
    """One torch thread for tiny models: faster, and steady on a busy 2-core CPU (more
    threads only contend)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def run(cmd, cwd, check=True):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if check and result.returncode:
        raise AssertionError(f"{cmd} failed:\n{result.stdout}\n{result.stderr}")
    return result


def small_params(repo_root) -> str:
    """The repository's params.yaml with a 12/4/4 demo dataset and one short epoch (of the
    models and of the detector)."""
    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    params["demo"].update(n_train=12, n_val=4, n_test=4)
    params["train"].update(epochs=1, batch_size=8)
    params["detector"].update(epochs=1)
    params["evaluate"].update(fold_size=2)  # 2 folds of 2 test images
    return yaml.safe_dump(params, sort_keys=False)


def copy_project(repo_root: Path, to: Path) -> Path:
    """The repository's files (tracked or not ignored) copied into a new git repo at ``to``,
    with :func:`small_params`."""
    files = run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], repo_root)
    for rel in files.stdout.splitlines():
        if (repo_root / rel).is_file():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo_root / rel, to / rel)
    run(["git", "init", "-q"], to)
    (to / "params.yaml").write_text(small_params(repo_root))
    return to


@pytest.fixture
def project(tmp_path, repo_root):
    """The repository copied into a new git repo (:func:`copy_project`)."""
    return copy_project(repo_root, tmp_path)


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory, repo_root) -> tuple[Path, str]:
    """A :func:`copy_project` after one ``dvc repro`` from scratch (the whole demo DAG: the
    suite's most expensive step, done once), and that run's stdout. Read only: a test that
    changes it works on a copy (:func:`copy_tree`).

    Under pytest-xdist (``make test``) the workers share one: the first to ask builds it in
    the run's common temp folder, under a file lock the others wait on."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder; each worker's basetemp is inside it
    root, stdout = shared / "reproduced" / "project", shared / "reproduced" / "repro.out"
    with FileLock(shared / "reproduced.lock"):
        if not stdout.is_file():
            shutil.rmtree(root.parent, ignore_errors=True)  # a failed build's leftovers
            root.parent.mkdir()
            copy_project(repo_root, root)
            stdout.write_text(run(["dvc", "repro"], root).stdout)
    return root, stdout.read_text()


def copy_tree(source: Path, to: Path) -> Path:
    """A full copy of ``source`` (outputs, DVC cache and run cache, git) at ``to``, with
    its modification times."""
    shutil.copytree(source, to, symlinks=True)
    return to
