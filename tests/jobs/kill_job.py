"""SIGKILL a `vse` command at chosen moments, in forked copies of one interpreter (the
imports are paid once, so many kills take seconds; two at a time where two CPUs are).

usage: python kill_job.py SPEC.json

SPEC: {"argv": [...], "base": folder, "preload": [modules]}. ``{dir}`` in ``argv`` is
replaced by each run's own folder under ``base``:

- ``clean``: a run to completion into an empty folder, counting its renames (what puts
  files in place) and its opens of files for writing;
- ``rename-K``: killed just before its K-th rename, for every K: each moment between two
  atomic writes;
- ``open-K``: killed just after its K-th ``open()`` of a file for writing, for every K (so
  that file exists, empty: what a writer that does not write aside leaves half-written);
- ``over``, ``over-rename-K``, ``over-open-K``: the same over a complete earlier output
  (a copy of ``clean``'s folder), which must survive or be replaced whole.

Prints one JSON line: ``{"counts": {"clean": [renames, opens], "over": [...]}, "runs":
{name: state}}`` with state "killed" or "exit N".
"""

import json
import os
import shutil
import signal
import sys


def preload(modules: list[str], params: bool) -> None:
    """What the command imports, before any fork (importing starts no thread)."""
    import importlib

    if "matplotlib.pyplot" in modules:
        import matplotlib

        matplotlib.use("Agg")
    for name in ["flows.cli", *modules]:
        importlib.import_module(name)
    if params:  # every section's model (imports torch, for the models'): built once
        from flows.params import params_model

        params_model()


def child(argv: list[str], kill_at, kill_open, count_file: str | None) -> None:
    """Run ``vse argv`` in this (forked) process; never returns."""
    import builtins
    import io

    renames, opens = [0], [0]

    def wrap(real):
        def renamed(*args, **kwargs):
            if renames[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            renames[0] += 1
            return real(*args, **kwargs)

        return renamed

    real_open = io.open

    def opened(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            if opens[0] == kill_open:
                os.kill(os.getpid(), signal.SIGKILL)
            opens[0] += 1
        return handle

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the child's output is not needed
    os.replace, os.rename, os.link = wrap(os.replace), wrap(os.rename), wrap(os.link)
    io.open = builtins.open = opened
    from flows.cli import main

    code = main(argv)
    if count_file:
        with real_open(count_file, "w") as f:
            f.write(f"{renames[0]} {opens[0]}")
    os._exit(code)


def start(argv, kill_at=None, count_file=None, kill_open=None) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            child(argv, kill_at, kill_open, count_file)
        finally:
            os._exit(99)
    return pid


def state(status: int) -> str:
    if os.WIFSIGNALED(status):
        return "killed"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def run_all(jobs: list[tuple], parallel: int) -> dict[str, str]:
    """Each ``(name, argv, kill_at, kill_open)``, ``parallel`` at a time (the runs share
    nothing but their read-only inputs): ``{name: state}`` in the order of ``jobs``."""
    states, running = {}, {}

    def reap() -> None:
        pid, status = os.wait()
        if pid in running:
            states[running.pop(pid)] = state(status)

    for name, argv, kill_at, kill_open in jobs:
        while len(running) >= parallel:
            reap()
        running[start(argv, kill_at, kill_open=kill_open)] = name
    while running:
        reap()
    return {job[0]: states[job[0]] for job in jobs}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    base = spec["base"]
    preload(spec.get("preload", []), "--params" in spec["argv"])
    parallel = min(2, len(os.sched_getaffinity(0)))

    def argv_for(name, over):
        folder = os.path.join(base, name)
        if over:  # a complete earlier output in place
            shutil.copytree(os.path.join(base, "clean"), folder)
        else:
            os.makedirs(folder)
        return [a.replace("{dir}", folder) for a in spec["argv"]]

    runs, counts = {}, {}
    count_file = os.path.join(base, "counts.txt")
    for mode, prefix in (("clean", ""), ("over", "over-")):
        over = mode == "over"
        runs[mode] = state(os.waitpid(start(argv_for(mode, over), count_file=count_file), 0)[1])
        renames, opens = map(int, open(count_file).read().split())
        os.unlink(count_file)
        counts[mode] = [renames, opens]
        jobs = [(f"{prefix}rename-{k}", k, None) for k in range(renames)]
        jobs += [(f"{prefix}open-{k}", None, k) for k in range(opens)]
        jobs = [(name, argv_for(name, over), at, op) for name, at, op in jobs]
        runs.update(run_all(jobs, parallel))
    print(json.dumps({"counts": counts, "runs": runs}))


if __name__ == "__main__":
    main()
