"""Team B reruns one stage of team A's reproduced project from only what that stage reads.

Given a project where ``dvc repro`` has run (``make demo``), this pushes its outputs to a
local DVC remote (a temp folder, set in ``.dvc/config.local``: nothing tracked changes),
clones the project with git, pulls into the clone what the stage reads (``vse pull``'s
:func:`flows.commands.pull.pull_inputs`), reruns the stage there by force, and compares
its outputs with team A's, byte for byte.

Figures: the stage's inputs that other stages write (bytes as ``dvc.lock`` records them)
against the whole DAG's outputs, the files and bytes actually fetched into the clone's
cache, the seconds of the pull and of the rerun (``dvc repro --single-item --force``,
DVC's checks included). A local remote measures what is fetched, not a network's speed.

    python benchmarks/team_b.py PROJECT [--stage evaluate@mvvse] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def sh(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(args, cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path, help="a project where dvc repro has run")
    parser.add_argument("--stage", default="evaluate@mvvse")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/team_b.json")
    args = parser.parse_args(argv)
    from dvc.repo import Repo

    from flows.commands.pull import pull_inputs

    project = args.project.resolve()
    with tempfile.TemporaryDirectory(prefix="team-b-") as tmp:
        remote, clone = Path(tmp) / "remote", Path(tmp) / "clone"
        sh(["dvc", "remote", "add", "--local", "-f", "-d", "bench", str(remote)], project)
        try:
            sh(["dvc", "push", "-q"], project)
        finally:
            sh(["dvc", "remote", "remove", "--local", "bench"], project)
        sh(["git", "clone", "-q", str(project), str(clone)], Path(tmp))
        sh(["dvc", "remote", "add", "--local", "-d", "bench", str(remote)], clone)
        pulled = pull_inputs(Repo(str(clone)), [args.stage])
        start = time.perf_counter()
        sh(["dvc", "repro", "--single-item", "--force", args.stage], clone)
        rerun_s = time.perf_counter() - start
        stage = Repo(str(clone)).stage.collect(args.stage)[0]
        outs = [str(o.def_path) for o in stage.outs]
        same = all((clone / p).read_bytes() == (project / p).read_bytes() for p in outs)
    result = {
        **pulled,
        "wanted_share": round(pulled["wanted_bytes"] / max(pulled["dag_bytes"], 1), 4),
        "wanted_mb": round(pulled["wanted_bytes"] / 2**20, 1),
        "dag_mb": round(pulled["dag_bytes"] / 2**20, 1),
        "fetched_mb": round(pulled["fetched_bytes"] / 2**20, 1),
        "rerun_s": round(rerun_s, 2),
        "rerun_outputs": outs,
        "rerun_outputs_identical": same,
        "project_commit": sh(["git", "rev-parse", "HEAD"], project).strip(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
