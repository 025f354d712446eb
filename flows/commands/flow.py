"""``vse flow NAME`` and ``vse prefect serve``: the DVC stages as Prefect flows."""

from __future__ import annotations

import json
import os

from flows.commands import command
from infra.config import UserError
from models.registry import MODEL_NAMES

FLOWS = ("features", "pipeline", *(f"train-{name}" for name in MODEL_NAMES))


def parse_overrides(items: list[str]) -> dict:
    """``-S key=value`` items -> {key: value}. A value is read as JSON when it is JSON
    (``0.5``, ``null``, ``true``, ``[8, 12]``, ``"a,b"``), else taken as a string
    (``bert-base-uncased``); a malformed item is a one-line error."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"-S {item!r}: expected KEY=VALUE, e.g. -S models.mvvse.lambda_=0.5")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return overrides


def flow_arguments(p) -> None:
    p.add_argument(
        "name",
        choices=FLOWS,
        help="train-MODEL: that model's train@ and evaluate@ stages and what they need",
    )
    p.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a params.yaml key for this run, which becomes a DVC experiment "
        "(VALUE is JSON, else a string: -S train.lr=0.0005 -S grid.weights=null)",
    )
    p.add_argument("--pull", action="store_true", help="dvc pull before running")
    p.add_argument("--push", action="store_true", help="dvc push --run-cache after running")
    p.add_argument("--remote", help="DVC remote for --pull/--push (default: the default one)")
    p.add_argument(
        "--dask-workers",
        type=int,
        default=0,
        help="features: extract the image stores over a local Dask cluster of N processes",
    )
    p.add_argument(
        "--dask-address", help="features: ... or over a running Dask scheduler (tcp://host:8786)"
    )


@command(
    "flow",
    help="run DVC stages as a Prefect flow (one task per stage, DVC's lock and cache)",
    description="features: every feature stage and what it needs; pipeline: the whole "
    "DAG; train-MODEL: one model's training and evaluation. With -S, the run is one DVC "
    "experiment with those params overridden.",
    arguments=flow_arguments,
    sections=("models",),
)
def run_flow(args, params) -> None:
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.deploy import TRAINING_FLOWS
    from flows.pipeline import features_flow, pipeline_flow

    overrides = parse_overrides(args.set)
    flows = {"features": features_flow, "pipeline": pipeline_flow}
    flows.update({f"train-{name}": TRAINING_FLOWS[name] for name in params.models.enabled})
    if args.name not in flows:
        raise UserError(
            f"{args.name}: {args.name[len('train-') :]} is not in models.enabled of params.yaml; "
            "add it there to train it"
        )
    extra = {}
    if args.dask_workers or args.dask_address:
        if args.name != "features":
            raise UserError("--dask-workers/--dask-address apply to the features flow only")
        extra = {"dask_workers": args.dask_workers, "dask_address": args.dask_address}
    states = flows[args.name](
        root=".",
        overrides=overrides or None,
        pull=args.pull,
        push=args.push,
        remote=args.remote,
        **extra,
    )
    print("flow: " + ", ".join(f"{stage} {state}" for stage, state in states.items()))


def serve_arguments(p) -> None:
    p.add_argument("--root", default=".", help="repository root the flows run in")
    p.add_argument("--limit", type=int, default=1, help="flow runs at a time (default 1)")


@command(
    "prefect serve",
    help="serve features, pipeline and train-MODEL as deployments <flow>/default",
    description="Registers every flow with the Prefect API (PREFECT_API_URL) and runs "
    "the flow runs it is asked for, e.g. `prefect deployment run train-mvvse/default "
    "-p overrides='{\"models.mvvse.lambda_\": 0.5}' --watch`. Stop with Ctrl-C.",
    arguments=serve_arguments,
    sections=None,
)
def run_serve(args, params) -> None:
    from flows.deploy import serve

    serve(args.root, args.limit)
