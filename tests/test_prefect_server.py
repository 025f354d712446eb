"""The docs' Prefect recipe (docs/how-to/prefect-deployment.md), run as written (another
port and PREFECT_HOME): a real server started with --background, `vse prefect serve`, a
plain deployment run and one with an override, which becomes a DVC experiment and leaves
the workspace as it was.

It runs in a copy of the session's reproduced demo (conftest's `reproduced`) with mvvse's
lambda_ changed: the features are up to date (the flows' own tests run them), and the
plain run trains and evaluates mvvse for real, as the override run does."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import REPO, copy_tree, run

LAMBDA = 0.6  # models.mvvse.lambda_ of the plain run: neither the demo's (0.7) nor the override


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RECIPE = REPO / "docs" / "how-to" / "prefect-deployment.md"


def docs_recipe() -> list[str]:
    """The command lines of the docs' deployment block (its first bash block under
    "Serve and run deployments")."""
    text = RECIPE.read_text()
    block = re.search(r"## Serve and run deployments\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_docs_recipe_serves_and_runs_deployments(reproduced, tmp_path, tmp_path_factory):
    project = copy_tree(reproduced[0], tmp_path / "project")
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["models"]["mvvse"]["lambda_"] not in (LAMBDA, 0.5)
    params["models"]["mvvse"]["lambda_"] = LAMBDA
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    home = tmp_path_factory.mktemp("prefect_home")
    port = str(_free_port())
    lines = [
        line.replace("4200", port).replace("$PWD/.prefect", str(home)) for line in docs_recipe()
    ]
    plain = next(i for i, line in enumerate(lines) if "deployment run" in line)
    assert "overrides" in lines[plain + 1], "the recipe's second run has an override"
    # a snapshot of the workspace after the plain run: the override run must leave it alone
    snapshot = f"cp params.yaml dvc.lock {home}/"
    script = ["set -euo pipefail", *lines[: plain + 1], snapshot, *lines[plain + 1 :]]
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "base"], project)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    for name in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        env.pop(name, None)  # the recipe sets them itself
    proc = subprocess.Popen(
        ["bash", "-c", "\n".join(script)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: nothing outlives the test
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                time.sleep(2)
            except ProcessLookupError:
                break
        subprocess.run(
            ["prefect", "server", "stop"],
            env={**env, "PREFECT_HOME": str(home)},
            capture_output=True,
        )
    assert proc.returncode == 0, out[-8000:]
    assert out.count("Completed") >= 2, out[-8000:]

    # the plain run trained and evaluated mvvse with the workspace's lambda_
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert lock["train@mvvse"]["params"]["params.yaml"]["models.mvvse"]["lambda_"] == LAMBDA
    metrics = json.loads((project / "metrics/evaluate/mvvse.json").read_text())
    assert metrics["model"] == "mvvse" and metrics["full"]["rsum"] > 0
    for name in ("params.yaml", "dvc.lock"):  # the override run left the workspace alone
        assert (project / name).read_text() == (home / name).read_text(), name
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    experiments = [e for row in shown for e in (row.get("experiments") or [])]
    names = [run_["name"] for e in experiments for run_ in e["revs"]]
    assert '"lambda_":0.5' in json.dumps(shown, separators=(",", ":"))
    # the artifact (printed by `prefect artifact inspect`) names the experiment
    named = re.search(r"DVC experiment `(train-mvvse-[0-9a-f]{8})`", out)
    assert named and named.group(1) in names, (names, out[-6000:])
