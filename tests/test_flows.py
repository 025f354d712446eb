"""Prefect flows over the DVC DAG, under prefect_test_harness, on a tiny project copy."""

import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import copy_project, copy_tree, run

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # a loaded machine is slow
        yield


@pytest.fixture(scope="module")
def flow_project(tmp_path_factory, repo_root, reproduced):
    """One project copy for this module's flows, without outputs but with the DVC cache of
    the session's reproduced demo (conftest's `reproduced`): a stage that demo ran with the
    same deps and params has its outputs restored from the run cache ("ran" all the same:
    the flow's part is to run `dvc repro` on each stage in order). What runs for real: the
    failing and the fixed `global` (params the demo never had) and vsepp's training, whose
    run-cache entry is removed for the preemption test. That test reuses the stages the
    first test built (run alone, it builds them itself)."""
    project = copy_project(repo_root, tmp_path_factory.mktemp("project"))
    copy_tree(reproduced[0] / ".dvc" / "cache", project / ".dvc" / "cache")
    runs = (project / ".dvc" / "cache" / "runs").glob("*/*/*")
    vsepp = [p for p in runs if yaml.safe_load(p.read_text())["cmd"].startswith("vse train vsepp")]
    assert len(vsepp) == 1, vsepp
    vsepp[0].unlink()
    return project


def test_dag_order_puts_dependencies_first(repo_root):
    from flows.pipeline import dag_order

    order = dag_order(repo_root)
    assert order.index("demo-data") < order.index("prepare") < order.index("regions")
    assert order.index("grid") < order.index("global") < order.index("train@vsepp")
    upstream = {"demo-data", "prepare", "detector", "grid", "global"}
    assert set(dag_order(repo_root, ["global"])) == upstream
    with pytest.raises(ValueError, match="unknown DVC stage"):
        dag_order(repo_root, ["nope"])


def test_flow_runs_stages_shares_dvc_lock_and_fails_loudly(harness, flow_project):
    project = flow_project
    from flows.pipeline import features_flow

    states = features_flow(root=str(project))
    assert set(states.values()) == {"ran"} and "adversarial" in states and "demo-data" in states
    plain = run(["dvc", "repro", *states], project)  # same dvc.lock and cache as the flow
    assert "Running stage" not in plain.stdout
    assert set(features_flow(root=str(project)).values()) == {"skipped"}

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["global"]["projection_dim"] = 4096  # more than the features have dimensions: fails
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(
        RuntimeError, match="(?s)global failed .*global.projection_dim 4096: needs"
    ) as err:
        features_flow(root=str(project))
    assert "Traceback" not in str(err.value)  # the stage's own clear message
    params["global"]["projection_dim"] = 8  # fixed: only global and what follows rerun
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    states = features_flow(root=str(project))
    assert states["global"] == "ran" and states["regions"] == "skipped"
    # overrides as a recorded DVC experiment: test_prefect_server, through a deployment


# Loaded by every Python process started with this folder on PYTHONPATH: in `vse train`
# with VSE_TEST_SIGTERM_AT set, SIGTERM to itself during that optimizer step (as a queue
# preempts a job); nothing elsewhere.
PREEMPT = """
import os, sys
at = int(os.environ.get("VSE_TEST_SIGTERM_AT", "0"))
if at and os.path.basename(sys.argv[0]) == "vse" and sys.argv[1:2] == ["train"]:
    import signal, torch
    original, count = torch.optim.AdamW.step, [0]
    def step(self, *args, **kwargs):
        count[0] += 1
        if count[0] == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)
    torch.optim.AdamW.step = step
"""


def test_a_preempted_training_flow_resumes_on_retry_and_rerun(
    harness, flow_project, tmp_path_factory, monkeypatch
):
    """train-vsepp with the trainer SIGTERMed at its 3rd step (exit 75): the task's retry
    goes on from last.pt (so it is stopped at step 6 of the epoch, not 3 again); the flow
    rerun goes on from step 6 and ends with the weights of an uninterrupted run."""
    import torch

    from flows.deploy import train_vsepp

    project = flow_project
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(PREEMPT)
    monkeypatch.setenv("PYTHONPATH", f"{hook}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("VSE_TEST_SIGTERM_AT", "3")
    last = project / "data" / "models" / "vsepp" / "last.pt"
    with pytest.raises(RuntimeError, match="train@vsepp failed") as err:
        train_vsepp(root=str(project))
    assert "75" in str(err.value), err.value
    within = torch.load(last, weights_only=True)["within"]
    assert (within["epoch"], within["step"]) == (0, 6)  # 3 steps, then 3 more on the retry

    monkeypatch.delenv("VSE_TEST_SIGTERM_AT")
    states = train_vsepp(root=str(project))
    assert states["train@vsepp"] == "ran" and states["evaluate@vsepp"] == "ran"
    resumed = torch.load(last, weights_only=True)
    assert resumed["within"] is None and resumed["epoch"] == 0
    assert not list((project / ".dvc" / "tmp" / "vse-resume").iterdir())

    # the same stage's command, uninterrupted, into another folder
    dvc = yaml.safe_load((project / "dvc.yaml").read_text())
    cmd = dvc["stages"]["train"]["do"]["cmd"]
    cmd = cmd.replace("${key}", "vsepp").replace("${item}", "global").split()
    paths = next(v["paths"] for v in dvc["vars"] if isinstance(v, dict) and "paths" in v)
    cmd = [re.sub(r"\$\{paths\.(\w+)\}", lambda m: paths[m.group(1)], a) for a in cmd]
    out = cmd.index("--out") + 1
    cmd[out] = str(tmp_path_factory.mktemp("whole"))
    for flag in ("--metrics", "--plots"):
        cmd[cmd.index(flag) + 1] = f"{cmd[out]}/{flag[2:]}.json"
    run(cmd, project)
    whole = torch.load(Path(cmd[out]) / "last.pt", weights_only=True)
    assert whole["history"] == resumed["history"]
    a, b = whole["state_dict"], resumed["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
