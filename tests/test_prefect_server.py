"""A real Prefect server on 127.0.0.1 (its own PREFECT_HOME), `vse prefect serve`, and
`prefect deployment run train-vsepp/default` with a param override, as a user would."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from conftest import run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    tails = "\n".join(f"--- {p}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"{what} not ready after {timeout} s\n{tails}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (twice: a Prefect runner needs two), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def test_served_deployment_trains_vsepp_with_an_override(project, tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect_home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "base"], project)
    server_log, serve_log = home / "server.log", home / "serve.log"
    with open(server_log, "w") as out:
        server = subprocess.Popen(
            ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    serve = None
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        _wait(healthy, 120, "prefect server", [server_log])
        with open(serve_log, "w") as out:
            serve = subprocess.Popen(
                ["vse", "prefect", "serve"],
                cwd=project,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def deployed() -> bool:
            result = subprocess.run(
                ["prefect", "deployment", "inspect", "train-vsepp/default"],
                env=env,
                capture_output=True,
                text=True,
            )
            return result.returncode == 0

        _wait(deployed, 120, "train-vsepp/default deployment", [serve_log, server_log])
        result = subprocess.run(
            [
                "prefect",
                "deployment",
                "run",
                "train-vsepp/default",
                "-p",
                'overrides={"models.vsepp.margin": 0.3}',
                "--watch",
                "--watch-timeout",
                "600",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=700,
        )
        logs = result.stdout + result.stderr + serve_log.read_text()
        assert result.returncode == 0, logs[-6000:]
        assert "Completed" in result.stdout + result.stderr, logs[-6000:]

        metrics = json.loads((project / "metrics/evaluate/vsepp.json").read_text())
        assert metrics["model"] == "vsepp" and metrics["full"]["rsum"] > 0
        lock = yaml.safe_load((project / "dvc.lock").read_text())
        params = lock["stages"]["train@vsepp"]["params"]["params.yaml"]
        assert params["models.vsepp"]["margin"] == 0.3
        experiments = "".join(run(["dvc", "exp", "show", "--json"], project).stdout.split())
        assert '"margin":0.3' in experiments
        artifact = subprocess.run(
            ["prefect", "artifact", "inspect", "evaluation-vsepp"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert artifact.returncode == 0 and "rsum" in artifact.stdout, artifact.stdout
    finally:
        if serve is not None:
            _stop(serve)
        _stop(server)
    assert server.poll() is not None
