"""``vse pull STAGE...``: pull from the DVC remote what the stages read, and nothing else.

``dvc pull`` fetches every output of the DAG (images, every store, every model), and
``dvc pull --with-deps STAGE`` every output upstream of it. A team that wants to rerun
or inspect one stage (``evaluate@mvvse``) needs only the outputs that stage reads: its
dependencies that other stages write. This pulls exactly those, and says how many bytes
that is of the whole DAG's data (the sizes ``dvc.lock`` records).
"""

from __future__ import annotations

import time
from collections.abc import Container
from pathlib import Path

from flows.commands import command
from infra.config import UserError, one_line


def stage_inputs(repo, targets: list[str], written: Container[str]) -> list[str]:
    """The dependencies of ``targets`` (stage names, ``foreach`` entries like
    ``evaluate@mvvse``) that are in ``written`` (the stages' outputs), in the repository's
    paths."""
    paths: set[str] = set()
    for target in targets:
        try:
            stages = repo.stage.collect(target)
        except Exception as err:  # noqa: BLE001 - DVC's own error, in one line
            raise UserError(
                f"{target}: no such stage in dvc.yaml ({type(err).__name__}); "
                "`dvc stage list` lists them"
            ) from None
        for stage in stages:
            paths.update(str(d.def_path) for d in stage.deps if str(d.def_path) in written)
    return sorted(paths)


def tree_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (0 if there is none)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def pull_inputs(repo, stages: list[str], remote=None, jobs=None) -> dict:
    """Pull what ``stages`` read (:func:`stage_inputs`); the figures of the pull."""
    from dvc.exceptions import DvcException

    sizes = {  # each stage output's size in bytes, as dvc.lock records it
        str(out.def_path): int((out.meta.size if out.meta else None) or 0)
        for stage in repo.index.stages
        for out in stage.outs
    }
    paths = stage_inputs(repo, stages, sizes)
    cache = Path(repo.cache.local.path)
    before, start = tree_bytes(cache), time.perf_counter()
    files = 0
    if paths:
        try:
            targets = [str(Path(repo.root_dir) / p) for p in paths]  # from any folder
            files = repo.pull(targets=targets, remote=remote, jobs=jobs)["stats"]["fetched"]
        except DvcException as err:
            raise UserError(
                f"pull {' '.join(stages)}: {one_line(err)}; check that a DVC remote is set "
                "(`dvc remote list`) and holds team A's outputs (`dvc push` there)"
            ) from None
    return {
        "stages": stages,
        "outputs": {p: sizes.get(p, 0) for p in paths},
        "wanted_bytes": sum(sizes.get(p, 0) for p in paths),
        "dag_bytes": sum(sizes.values()),
        "fetched_files": files,
        "fetched_bytes": tree_bytes(cache) - before,
        "seconds": round(time.perf_counter() - start, 2),
    }


def arguments(p) -> None:
    p.add_argument("stages", nargs="+", help="stages, e.g. evaluate@mvvse train@huse")
    p.add_argument("-r", "--remote", help="DVC remote (default: the project's default)")
    p.add_argument("-j", "--jobs", type=int, help="parallel transfers (DVC's default)")


@command(
    "pull",
    help="pull from the DVC remote only the outputs that the given stages read",
    arguments=arguments,
    sections=None,
    description=__doc__,
)
def run(args, params) -> None:
    from dvc.repo import Repo

    pulled = pull_inputs(Repo("."), args.stages, args.remote, args.jobs)
    names = " ".join(args.stages)
    if not pulled["outputs"]:
        print(f"pull {names}: the stage(s) read no other stage's outputs")
        return
    wanted, total = pulled["wanted_bytes"], pulled["dag_bytes"]
    print(
        f"pull {names}: {len(pulled['outputs'])} output(s) of other stages, "
        f"{wanted / 2**20:.1f} MB of the DAG's {total / 2**20:.1f} MB "
        f"({wanted / max(total, 1):.0%}); fetched {pulled['fetched_files']} file(s), "
        f"{pulled['fetched_bytes'] / 2**20:.1f} MB, in {pulled['seconds']:.1f} s"
    )
    for path, size in pulled["outputs"].items():
        print(f"  {path}  {size / 2**20:.1f} MB")
