"""``vse params``: validate params.yaml and print it with every default filled in."""

from __future__ import annotations

import yaml

from flows.commands import command


@command("params", help="validate params.yaml and print it with defaults")
def run(args, params) -> None:
    print(yaml.safe_dump(params.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
