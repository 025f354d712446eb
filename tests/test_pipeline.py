"""The DVC pipeline end to end, in a copy of the repository with a tiny demo."""

import json

from conftest import copy_tree, run

# stages whose outputs used to carry times or throughput; rerun, they must not change
RERUN = ["prepare", "regions", "grid", "global", "text", "scenegraph", "adversarial"]
RERUN += ["train@vsepp", "evaluate@vsepp"]


def test_repro_runs_everything_once_reproducibly_and_team_b_gets_it_without_recomputing(
    reproduced, tmp_path, tmp_path_factory
):
    """The whole DAG (features, five models trained and evaluated, report), then nothing;
    rerun by force, the outputs are byte-identical; team A pushes outputs and run cache,
    and team B recomputes nothing, with A's dvc.lock or without it, and reruns one
    evaluation from only the outputs it reads (`vse pull`) (one project for all:
    the DAG is the suite's most expensive part, and the first `dvc repro` is the session's
    `reproduced`, which this test checks, then goes on with in a copy of its own)."""
    built, first = reproduced  # the project, the first `dvc repro`'s stdout
    project = copy_tree(built, tmp_path / "project")
    for stage in ("demo-data", "prepare", "adversarial", "train@univse", "report"):
        assert f"Running stage '{stage}'" in first
    assert (project / "data/prepared/manifest.parquet").is_file()
    assert "read 20 records, kept 20" in first
    report = (project / "reports/models.md").read_text()
    assert all(f"| {m} |" in report for m in ("vsepp", "mvvse", "camera", "huse", "univse"))
    second = run(["dvc", "repro"], project)
    assert "Running stage" not in second.stdout
    assert "Data and pipelines are up to date" in second.stdout

    lock = (project / "dvc.lock").read_text()
    forced = run(["dvc", "repro", "--force", "--single-item", *RERUN], project)
    assert all(f"Running stage '{stage}'" in forced.stdout for stage in RERUN)
    assert (project / "dvc.lock").read_text() == lock, "a rerun changed an output's hash"

    remote = tmp_path_factory.mktemp("remote")
    run(["dvc", "remote", "add", "-d", "team", str(remote)], project)
    run(["dvc", "push", "--run-cache"], project)
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=a", "-c", "user.email=a@x", "commit", "-qm", "team A"], project)
    checkpoint = (project / "data/models/vsepp/best.pt").read_bytes()
    for name, how, keep_lock in (
        ("without A's dvc.lock", ["dvc", "repro", "--pull"], False),
        ("with A's dvc.lock", ["dvc", "pull"], True),
    ):
        clone = tmp_path_factory.mktemp("team_b") / "repo"
        run(["git", "clone", "-q", str(project), str(clone)], clone.parent)
        if not keep_lock:
            (clone / "dvc.lock").unlink()
        result = run(how, clone)
        assert "Running stage" not in result.stdout, (name, result.stdout)
        assert (clone / "data/models/vsepp/best.pt").read_bytes() == checkpoint, name
        if not keep_lock:  # the run cache gave the same outputs, so the same lock
            assert (clone / "dvc.lock").read_text() == lock, name
        status = run(["dvc", "status"], clone)
        assert "up to date" in status.stdout, (name, status.stdout)

    # team B reruns one evaluation: `vse pull` fetches what that stage reads, nothing else
    clone = tmp_path_factory.mktemp("team_b") / "repo"
    run(["git", "clone", "-q", str(project), str(clone)], clone.parent)
    pulled = run(["vse", "pull", "evaluate@mvvse"], clone).stdout
    assert "pull evaluate@mvvse: 8 output(s) of other stages" in pulled, pulled
    for path in ("data/models/mvvse/best.pt", "data/features/regions.zarr/zarr.json"):
        assert (clone / path).is_file(), path
    for path in ("data/demo/images", "data/models/vsepp", "data/features/grid.zarr"):
        assert not (clone / path).exists(), path  # upstream or beside it: not fetched
    evaluated = run(["dvc", "repro", "--single-item", "--force", "evaluate@mvvse"], clone)
    assert "Running stage 'evaluate@mvvse'" in evaluated.stdout
    for path in ("metrics/evaluate/mvvse.json", "data/gallery/mvvse.json"):
        assert (clone / path).read_bytes() == (project / path).read_bytes(), path


def test_broken_params_fail_before_any_work(project):
    broken = (project / "params.yaml").read_text().replace("n_train", "n_trian")
    (project / "params.yaml").write_text(broken)
    result = run(["dvc", "repro"], project, check=False)
    assert result.returncode != 0
    assert "demo.n_trian: unknown key, did you mean n_train" in result.stdout + result.stderr
    assert not (project / "data/demo/images").exists()


def test_committed_lock_matches_the_code(project):
    """dvc.lock must be regenerated (dvc repro) and committed whenever stage code changes,
    or a new user's first `make demo` leaves dvc.lock modified."""
    status = json.loads(run(["dvc", "status", "--json"], project).stdout)
    stale = [
        (stage, change)
        for stage, changes in status.items()
        for change in changes
        if isinstance(change, dict)
        for path, state in change.get("changed deps", {}).items()
        if path.endswith(".py") and state == "modified"
    ]
    assert not stale, f"dvc.lock is stale for {stale}: run `dvc repro` and commit dvc.lock"


def test_pull_names_an_unknown_stage_and_a_missing_remote_in_one_line(project):
    wrong = run(["vse", "pull", "evaluate@nomodel"], project, check=False)
    assert wrong.returncode != 0
    assert "evaluate@nomodel: no such stage in dvc.yaml" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    nowhere = run(["vse", "pull", "evaluate@mvvse"], project, check=False)
    assert nowhere.returncode != 0 and len(nowhere.stderr.strip().splitlines()) == 1
    assert "pull evaluate@mvvse: " in nowhere.stderr and "remote" in nowhere.stderr
