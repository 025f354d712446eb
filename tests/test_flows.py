"""Prefect flows over the DVC DAG, under prefect_test_harness, on a tiny project copy."""

import os

import pytest
import yaml
from conftest import run

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


def test_dag_order_puts_dependencies_first(repo_root):
    from flows.pipeline import dag_order

    order = dag_order(repo_root)
    assert order.index("demo-data") < order.index("prepare") < order.index("regions")
    assert order.index("grid") < order.index("global") < order.index("train@vsepp")
    upstream = {"demo-data", "prepare", "detector", "grid", "global"}
    assert set(dag_order(repo_root, ["global"])) == upstream
    with pytest.raises(ValueError, match="unknown DVC stage"):
        dag_order(repo_root, ["nope"])


def test_flow_runs_stages_shares_dvc_lock_and_fails_loudly(harness, project):
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
