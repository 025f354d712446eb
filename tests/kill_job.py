"""SIGKILL a `vse` command at chosen moments, in forked copies of one interpreter (the
imports are paid once, so many kills take seconds).

usage: python kill_job.py SPEC.json

SPEC: {"argv": [...], "base": folder, "fractions": [..], "max_points": n, "preload":
[modules]}. ``{dir}`` in
``argv`` is replaced by each run's own folder under ``base``:

- ``clean``: a run to completion, timed, counting the renames that put files in place;
- ``rename-K``: killed just before its K-th rename (every rename, or ``max_points`` of
  them evenly spread): each moment between two atomic writes;
- ``open-K``: killed just after its K-th ``open()`` of a file for writing (so that file
  exists, empty: what a writer that does not write aside leaves half-written), spread
  likewise;
- ``time-F``: killed F x the clean run's duration after its start (mid-write moments);
- ``old-F``: the same, over a complete earlier output (which must survive or be replaced
  whole).

Prints one JSON line: ``{"renames": n, "opens": n, "seconds": s, "runs": {name: state}}``
with state "killed" or "exit N".
"""

import json
import os
import signal
import sys
import time


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


def run(argv, kill_at=None, kill_after=None, count_file=None, kill_open=None) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            child(argv, kill_at, kill_open, count_file)
        finally:
            os._exit(99)
    if kill_after is not None:
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return "exit early"
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        return "killed"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    base = spec["base"]
    preload(spec.get("preload", []), "--params" in spec["argv"])

    def argv_for(name):
        folder = os.path.join(base, name)
        os.makedirs(folder, exist_ok=True)
        return [a.replace("{dir}", folder) for a in spec["argv"]]

    runs = {}
    count_file = os.path.join(base, "renames.txt")
    start = time.monotonic()
    runs["clean"] = run(argv_for("clean"), count_file=count_file)
    seconds = time.monotonic() - start
    renames, opens = map(int, open(count_file).read().split())
    os.unlink(count_file)

    def spread(count):
        n = spec.get("max_points", count)
        if count <= n:
            return list(range(count))
        return sorted({round(i * (count - 1) / (n - 1)) for i in range(n)})

    for k in spread(renames):
        runs[f"rename-{k}"] = run(argv_for(f"rename-{k}"), kill_at=k)
    for k in spread(opens):
        runs[f"open-{k}"] = run(argv_for(f"open-{k}"), kill_open=k)
    for f in spec.get("fractions", []):
        runs[f"time-{f}"] = run(argv_for(f"time-{f}"), kill_after=f * seconds)
        old = argv_for(f"old-{f}")
        run(old)
        runs[f"old-{f}"] = run(old, kill_after=f * seconds)
    print(json.dumps({"renames": renames, "opens": opens, "seconds": seconds, "runs": runs}))


if __name__ == "__main__":
    main()
