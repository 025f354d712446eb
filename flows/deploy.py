"""One Prefect training flow per model, and the deployments that serve every flow.

``train-<model>`` reproduces the model's ``evaluate@<model>`` DVC stage and everything it
needs (features, ``train@<model>``), exactly like ``dvc repro evaluate@<model>``: DVC's
lock and cache decide what runs. The run gets a Markdown artifact with the evaluation
table. ``serve`` registers ``features``, ``pipeline`` and the five training flows as
deployments named ``default`` and runs them on request::

    vse prefect serve                                   # in the repository root
    prefect deployment run train-mvvse/default -p overrides='{"models.mvvse.lambda_": 0.5}' --watch
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

from prefect import flow, get_run_logger

from flows.pipeline import features_flow, pipeline_flow, run_flow, stage_metrics
from infra.config import UserError


def attach_evaluation(model: str, overrides: dict | None, workspace: Path, experiment) -> None:
    """Attach the evaluation table of ``evaluate@<model>`` in ``workspace`` to the run."""
    from prefect.artifacts import create_markdown_artifact

    from models.report.table import markdown_table

    results = {}
    for path in stage_metrics(workspace, f"evaluate@{model}"):
        result = json.loads(path.read_text())
        results[result.get("model", model)] = result
    table = markdown_table(results)
    if experiment:
        table += (
            f"\nDVC experiment `{experiment}` (`dvc exp show`, `dvc exp apply {experiment}`)"
            ", params overridden: "
            + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in overrides.items())
        )
    create_markdown_artifact(
        markdown=f"# {model}: evaluation\n\n{table}",
        key=f"evaluation-{model}",
        description=f"{model} retrieval metrics on the evaluation split"
        + (f" (experiment {experiment})" if experiment else ""),
    )
    get_run_logger().info("evaluation of %s:\n%s", model, table)


def _training_flow(model: str):
    def run(
        root: str = ".",
        overrides: dict | None = None,
        pull: bool = False,
        push: bool = False,
        remote: str | None = None,
    ) -> dict[str, str]:
        collect = functools.partial(attach_evaluation, model, overrides)
        stages = [f"evaluate@{model}"]
        return run_flow(
            f"train-{model}", stages, root, overrides, pull, push, remote, collect=collect
        )

    # a module-level name Prefect can load the flow by (the deployment's entrypoint)
    run.__name__ = run.__qualname__ = f"train_{model}"
    run.__doc__ = f"Train and evaluate {model}: `dvc repro evaluate@{model}` as Prefect tasks."
    return flow(name=f"train-{model}", log_prints=True)(run)


TRAINING_FLOWS = {m: _training_flow(m) for m in ("vsepp", "mvvse", "camera", "huse", "univse")}
# module-level names, the deployments' entrypoints (flows.deploy:train_vsepp, ...)
train_vsepp, train_mvvse, train_camera, train_huse, train_univse = TRAINING_FLOWS.values()


def serve(root: str | Path = ".", limit: int = 1) -> None:
    """Serve the features and pipeline flows and the training flow of each model of
    ``models.enabled`` as deployment ``<flow>/default`` until interrupted; runs start in
    this process's environment with ``root`` (absolute) as the repository. ``limit`` runs
    at a time: DVC serialises stages on one repository anyway."""
    from prefect import serve as prefect_serve

    from flows.params import load_params

    wait_for_server()
    root = str(Path(root).resolve())
    enabled = load_params(Path(root) / "params.yaml").models.enabled  # the DAG's models
    flows = [features_flow, pipeline_flow, *(TRAINING_FLOWS[m] for m in enabled)]
    deployments = [
        f.to_deployment(
            name="default",
            parameters={"root": root},
            description=f.description.strip().splitlines()[0] if f.description else None,
        )
        for f in flows
    ]
    prefect_serve(*deployments, limit=limit)


def wait_for_server(timeout: float = 120.0) -> None:
    """Wait until the Prefect API at ``PREFECT_API_URL`` answers (a server started with
    ``--background`` takes 10-20 s); without one configured, Prefect starts its own."""
    import time
    import urllib.request

    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        return
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):  # not up yet
            with urllib.request.urlopen(f"{api.rstrip('/')}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        if time.monotonic() > deadline:
            raise UserError(
                f"no Prefect server answers at {api} after {timeout:.0f} s; start one "
                "(prefect server start --background) or unset PREFECT_API_URL"
            )
        time.sleep(1)
