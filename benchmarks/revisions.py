"""One benchmark script, two revisions of the code, in one run: the throughput change.

Checks out BEFORE and AFTER (default: the working tree) side by side, then runs the
benchmark script of each revision against its own code, alternating BEFORE, AFTER,
BEFORE, ... for ``--rounds`` rounds so that both see the same load on a shared machine.
Every table row the scripts print (a label, then its figure: ``reader   1234  ...``) is
paired by its section and label; the best figure of each side counts (the benchmarks
print rates: higher is better). Prints each row's figures and ratio AFTER / BEFORE, and
writes them to ``--out`` (JSON).

    python benchmarks/revisions.py 7f1c1e0 \\
        --baseline "memmap gather + float32 + padding (baseline)" \\
        -- benchmarks/train_input.py --images 2048
    python benchmarks/revisions.py 7f1c1e0 --out benchmarks/results/revisions/store_read.json \\
        -- benchmarks/store_read.py --n 1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^(?P<label>\S.*?)\s{2,}(?P<value>\d+(?:\.\d+)?)(?:\s|$)")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def rows(output: str, baseline: str | None = None) -> dict[str, float]:
    """``{"section | label": first figure}`` of every table row in a benchmark's output.
    A section is the first line of a paragraph (after a blank line) that is not a row, its
    numbers blanked (a load figure in it does not split a section). With ``baseline``, each
    figure is divided by the figure of the row of that label in its section (a reader
    that does not depend on the code: the ratio cancels the machine's load of the run)."""
    found, section, blank = {}, "", True
    for line in output.splitlines():
        match = ROW.match(line)
        if match and not line.startswith(" "):
            found[f"{section} | {match['label'].strip()}"] = float(match["value"])
        elif line.strip() and blank:
            section = NUMBER.sub("#", line.strip())
        blank = not line.strip()
    if baseline:
        base = {k.split(" | ")[0]: v for k, v in found.items() if k.endswith(f" | {baseline}")}
        found = {
            k: v / base[k.split(" | ")[0]] for k, v in found.items() if base.get(k.split(" | ")[0])
        }
    return found


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(into), rev], check=True
    )
    return into


def run(tree: Path, script: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(tree / script), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{script} at {tree} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def compare(before: list[dict], after: list[dict]) -> dict[str, dict]:
    """Per row present in every run of both sides: best BEFORE, best AFTER, their ratio."""
    common = set.intersection(*(set(r) for r in before + after))
    table = {}
    for key in sorted(common, key=lambda k: list(before[0]).index(k)):
        b, a = max(r[key] for r in before), max(r[key] for r in after)
        table[key] = {"before": b, "after": a, "ratio": round(a / b, 3) if b else None}
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="git revision measured first")
    ap.add_argument("--after", default=None, help="git revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the table here (JSON)")
    ap.add_argument(
        "--baseline", default=None, help="row label each figure is divided by, run by run"
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        ap.error("name the benchmark script after --: ... -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if not command:
        ap.error("name the benchmark script after --")
    script, script_args = command[0], command[1:]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": checkout(args.before, Path(tmp) / "before")}
        trees["after"] = checkout(args.after, Path(tmp) / "after") if args.after else REPO
        try:
            outputs = {"before": [], "after": []}
            for k in range(args.rounds):
                for side, tree in trees.items():
                    print(f"round {k + 1}/{args.rounds}: {side} ...", flush=True)
                    outputs[side].append(rows(run(tree, script, script_args), args.baseline))
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(
                        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)]
                    )
    table = compare(outputs["before"], outputs["after"])
    width = max((len(k) for k in table), default=10)
    print(f"\n{script} {' '.join(script_args)}: best of {args.rounds} runs each")
    print(f"{'row':<{width}}{'before':>11}{'after':>11}{'after/before':>14}")
    for key, r in table.items():
        print(f"{key:<{width}}{r['before']:>11.3f}{r['after']:>11.3f}{r['ratio']:>14.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"script": script, "args": script_args, "before": args.before}
        meta |= {"after": args.after or "working tree", "rounds": args.rounds}
        meta |= {"baseline": args.baseline}
        args.out.write_text(json.dumps({**meta, "rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
