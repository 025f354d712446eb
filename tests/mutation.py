"""Mutation testing of the code whose output users read (``make mutation``; slow, not in CI).

mutmut (configured in ``pyproject.toml``, ``[tool.mutmut]``) makes one-line changes to the
functions named by ``TARGETS`` and runs the tests that reach each of them; a mutant that no
test notices *survives*. A survivor is either killed by a new test or listed in
``tests/mutation_equivalent.txt`` with one line saying why it cannot change a result (an
equivalent mutant). This script runs mutmut over ``TARGETS`` (or reads the last run with
``--report``), prints the score per module with the equivalent mutants set aside, and
lists every survivor that is neither killed nor explained. It exits non-zero when one is
left or the score is under ``--min-score``.

    python tests/mutation.py                 # run (about 30-60 min on 2 cores) and report
    python tests/mutation.py --report        # report the last run again
    python tests/mutation.py 'models.metrics.*'   # one module (mutmut's name globs)
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT = REPO / "tests" / "mutation_equivalent.txt"

# mutmut's mutant names: <module>.x_<function>__mutmut_<n>, or
# <module>.xǁ<Class>ǁ<method>__mutmut_<n>. Plots are left out: a figure is looked at, and
# what it draws is the tested data beside it.
TARGETS = [
    "models.metrics.*",  # R@K, medr, meanr, rsum, folds
    "models.evaluate.*",  # evaluation: whole split, folds, adversarial, classification
    "models.report.table.x_chance_rsum*",  # the report's numbers and table
    "models.report.table.x__fmt*",
    "models.report.table.x_markdown_table*",
    "models.common.*",  # the losses' shared parts (hinge, similarities, pooling)
    "models.vsepp.*",  # the five models and their losses
    "models.mvvse.*",
    "models.camera.*",
    "models.huse.*",
    "models.univse.*",
    "features.images.select.x_butd_select*",  # bottom-up-attention region selection
    "features.images.select.x__max_conf_from*",
    "features.images.select.x__grouped_nms*",
    "features.text.sbert_stats.x_pairwise_similarities*",  # Sentence-BERT caption statistics
    "features.text.sbert_stats.x_summarise*",
    "features.text.sbert_stats.x_caption_statistics*",
    "features.detector.metrics.x_average_precision*",  # detector metrics
    "features.detector.metrics.x_voc_ap_per_class*",
    "features.detector.metrics.x__recall*",
    "features.detector.metrics.x_evaluate_detector*",
    "features.exchange.*",  # precomp and bottom-up-attention TSV import/export
]

LINE = re.compile(r"^\s+(\S+): (.+)$")


def module_of(name: str) -> str:
    """``models.metrics.x_fold_metrics__mutmut_3`` -> ``models.metrics``."""
    return re.split(r"\.xǁ|\.x_", name, maxsplit=1)[0]


def read_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """``name  # why`` per line (blank lines and lines starting with ``#`` skipped)."""
    out = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, why = line.partition("#")
        if not sep or not why.strip():
            sys.exit(f"error: {path}:{n}: '{name.strip()}' needs '# why it is equivalent'")
        out[name.strip()] = why.strip()
    return out


def results() -> dict[str, str]:
    """Every mutant of the last run and its status (killed, survived, timeout ...)."""
    out = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode:
        sys.exit(f"error: mutmut results failed: {out.stderr.strip().splitlines()[-1:]}")
    return {m.group(1): m.group(2) for m in map(LINE.match, out.stdout.splitlines()) if m}


def report(statuses: dict[str, str], patterns: list[str], min_score: float) -> int:
    chosen = {k: v for k, v in statuses.items() if any(fnmatch.fnmatch(k, p) for p in patterns)}
    equivalent = read_equivalent()
    counts: dict[str, Counter] = defaultdict(Counter)
    left = []
    for name, status in sorted(chosen.items()):
        mod = module_of(name)
        if status == "survived" and name in equivalent:
            counts[mod]["equivalent"] += 1
        elif status in ("killed", "timeout", "segfault"):
            counts[mod]["killed"] += 1  # a mutant that hangs or crashes the tests is caught
        elif status == "survived":
            counts[mod]["survived"] += 1
            left.append(name)
        else:
            counts[mod][status] += 1
    print(f"{'module':28} {'mutants':>8} {'killed':>7} {'equiv.':>7} {'survived':>9} {'score':>6}")
    total = Counter()
    for mod, c in sorted(counts.items()):
        total.update(c)
        n = sum(c.values())
        scored = c["killed"] + c["survived"]
        score = 100.0 * c["killed"] / scored if scored else 100.0
        row = f"{c['killed']:7d} {c['equivalent']:7d} {c['survived']:9d} {score:5.1f}%"
        print(f"{mod:28} {n:8d} {row}")
    scored = total["killed"] + total["survived"]
    score = 100.0 * total["killed"] / scored if scored else 100.0
    print(
        f"{'all':28} {sum(total.values()):8d} {total['killed']:7d} {total['equivalent']:7d}"
        f" {total['survived']:9d} {score:5.1f}%"
    )
    other = {k: v for k, v in total.items() if k not in ("killed", "survived", "equivalent")}
    if other:
        print(f"not scored: {dict(other)} (no tests reach them, or the run was cut short)")
    stale = sorted(n for n in equivalent if chosen and n in chosen and chosen[n] != "survived")
    for name in stale:
        print(f"note: {name} is listed as equivalent but was {chosen[name]}: drop the line")
    for name in left:
        print(f"survived: {name}   (mutmut show {name})")
    if left or score < min_score:
        print(
            f"{len(left)} survivor(s) neither killed nor explained; score {score:.1f}% "
            f"(at least {min_score:.0f}% wanted)"
        )
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", help="mutant name globs (default: TARGETS)")
    ap.add_argument("--report", action="store_true", help="report the last run, run nothing")
    ap.add_argument("--min-score", type=float, default=85.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    patterns = args.patterns or TARGETS
    if not args.report:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per mutant process
        cmd = ["mutmut", "run", "--max-children", str(args.jobs), *patterns]
        done = subprocess.run(cmd, cwd=REPO, env=env)
        if done.returncode:
            return done.returncode
    return report(results(), patterns, args.min_score)


if __name__ == "__main__":
    sys.exit(main())
