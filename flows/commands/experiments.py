"""``vse exp show``: DVC experiments as a table that fits a terminal.

``dvc exp show`` lists every param and metric with its file path (hundreds of columns
here); this keeps the params that differ between the rows and each model's evaluation
rsum, with short names. The same data: ``dvc exp show --json``.
"""

from __future__ import annotations

import json
import subprocess

from flows.commands import command, text_table
from infra.config import UserError


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _rows(shown: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, flat params, {model: rsum}) of the workspace, each commit and experiment."""
    rows = []

    def add(name: str, data: dict | None) -> None:
        data = data or {}
        params = _flat(((data.get("params") or {}).get("params.yaml") or {}).get("data") or {})
        rsum = {}
        for path, metric in (data.get("metrics") or {}).items():
            if path.startswith("metrics/evaluate/") and metric.get("data"):
                model = path.rsplit("/", 1)[-1].removesuffix(".json")
                rsum[model] = (metric["data"].get("full") or {}).get("rsum")
        rows.append((name, params, rsum))

    for row in shown:
        add(row.get("name") or row["rev"], row.get("data"))
        for experiment in row.get("experiments") or []:
            for rev in experiment.get("revs") or []:
                add(f"  {rev.get('name') or rev['rev'][:7]}", rev.get("data"))
    return rows


def table(shown: list[dict]) -> str:
    """The compact table of ``dvc exp show --json``'s output."""
    rows = _rows(shown)
    keys = sorted({k for _, p, _ in rows for k in p})
    changed = [k for k in keys if len({json.dumps(p.get(k)) for _, p, _ in rows}) > 1]
    models = sorted({m for _, _, r in rows for m in r})
    header = ["experiment", *changed, *(f"{m} rsum" for m in models)]
    body = [
        [
            name,
            *(json.dumps(p.get(k)) if k in p else "-" for k in changed),
            *(f"{r[m]:.1f}" if r.get(m) is not None else "-" for m in models),
        ]
        for name, p, r in rows
    ]
    text = text_table(header, body)
    return text if changed else f"{text}\n(no param differs between these rows)"


@command(
    "exp show",
    help="DVC experiments in a narrow table: params that differ, rsum per model",
    description="The params that differ between the workspace, commits and experiments, "
    "and each model's evaluation rsum (dvc exp show --json has everything).",
    sections=None,
)
def run(args, params) -> None:
    result = subprocess.run(["dvc", "exp", "show", "--json"], capture_output=True, text=True)
    if result.returncode:
        raise UserError(f"dvc exp show failed: {result.stderr.strip().splitlines()[-1:]}")
    print(table(json.loads(result.stdout)))
