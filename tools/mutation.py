"""Mutation testing of the code whose output users read (``make mutation``; slow, not in CI).

mutmut (configured in ``pyproject.toml``, ``[tool.mutmut]``) makes one-line changes to the
functions named by ``TARGETS`` and runs the tests that reach each of them; a mutant that no
test notices *survives*. A survivor is either killed by a new test or listed in
``tools/mutation_equivalent.txt`` with one line saying why it cannot change a result (an
equivalent mutant). This script runs mutmut over ``TARGETS`` (or reads the last run with
``--report``), prints the score per module with the equivalent mutants set aside, and
lists every survivor that is neither killed nor explained. Unreached mutants (no selected
test calls the function, or the run was cut short) count as survivors.

Each equivalent entry is pinned to its mutant: ``NAME  PIN  # why``, where PIN hashes the
mutated function before and after the mutation (:func:`pin_of`). An entry whose mutant no
longer exists, whose function changed since the reason was written, that has no pin, or
that a test kills, fails the run; so does a survivor left unexplained, or a module scoring
under ``--min-score``.

    python tools/mutation.py                 # run (about an hour on 2 cores) and report
    python tools/mutation.py --report        # report the last run again
    python tools/mutation.py 'models.metrics.*'   # one module (mutmut's name globs)
    python tools/mutation.py --generate --review   # mutants only: each entry's diff and why
    python tools/mutation.py --pin           # pin entries without a pin (after a review)
    python tools/mutation.py --report --write   # the per-module table for the docs
    python tools/mutation.py --slow-tests 2     # leave tests over 2 s out of later runs
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
EQUIVALENT = REPO / "tools" / "mutation_equivalent.txt"
SCORES = REPO / "tools" / "mutation_scores.json"  # --write: the per-module table of the docs
MUTMUT = str(Path(sys.executable).with_name("mutmut"))  # beside this Python: no PATH needed

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
    # what tells users that something is wrong, and the files they read
    "features.store.integrity.*",  # checksums, commit markers, vse store verify
    "features.shards.reader.x_read_sizes*",  # the shards' manifest
    "features.shards.reader.x_check_sources*",  # shards against the stores they came from
    "features.images.global_features.x_pooled_features*",  # pooled global features, PCA
    "features.images.global_features.x_fit_pca*",
    "features.images.global_features.x_project*",
    "models.train.x_write_history*",  # the training history (metrics JSON and plot data)
    "models.train.x_load_checkpoint*",  # checkpoint loading
    "infra.resume.x_read_checkpoint*",
]

LINE = re.compile(r"^\s+(\S+): (.+)$")
KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # the tests noticed
# every other status is scored as a survivor: "survived", and the unreached ones ("no
# tests": no selected test calls the function; "not checked": the run was cut short;
# "suspicious", "skipped")


def module_of(name: str) -> str:
    """``models.metrics.x_fold_metrics__mutmut_3`` -> ``models.metrics``."""
    return re.split(r"\.xǁ|\.x_", name, maxsplit=1)[0]


class Entry(NamedTuple):
    pin: str  # the mutant's fingerprint when the reason was written ("" if not pinned)
    why: str


def read_equivalent(path: Path | None = None) -> dict[str, Entry]:
    """``name  pin  # why`` per line (blank lines and lines starting with ``#`` skipped)."""
    path = path or EQUIVALENT
    out = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, sep, why = line.partition("#")
        words = head.split()
        if not sep or not why.strip() or len(words) not in (1, 2):
            sys.exit(f"error: {path}:{n}: write 'NAME  PIN  # why it is equivalent'")
        out[words[0]] = Entry(words[1] if len(words) == 2 else "", why.strip())
    return out


def write_pins(pins: dict[str, str], path: Path | None = None) -> int:
    """Fill in the pin of every entry that has none; entries already pinned stay as they
    are (a pin that no longer matches is reviewed by hand, then its pin deleted and
    refilled here). Returns the number of pins written."""
    path = path or EQUIVALENT
    lines, written = [], 0
    for line in path.read_text().splitlines():
        head, sep, why = line.partition("#")
        words = head.split()
        if sep and len(words) == 1 and words[0] in pins:
            line = f"{words[0]}  {pins[words[0]]}  #{why}"
            written += 1
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return written


def mutant_functions(name: str) -> tuple[str, str] | None:
    """The original function and the mutant, as mutmut generated them into ``mutants/``
    (both under the function's own name), or None when no such mutant exists there."""
    import libcst as cst
    from mutmut.mutation import diff_apply

    path = Path(*module_of(name).split(".")).with_suffix(".py")
    if not (REPO / "mutants" / path).exists():
        return None
    cwd = os.getcwd()
    os.chdir(REPO)  # mutmut reads mutants/ relative to the working folder
    try:
        funcs = diff_apply.read_functions_from_index(name, path)
        if funcs is None:
            module = diff_apply.read_mutants_module(path)
            funcs = (
                diff_apply.read_original_function(module, name),
                diff_apply.read_mutant_function(module, name),
            )
    except (FileNotFoundError, KeyError, ValueError):
        return None
    finally:
        os.chdir(cwd)
    orig, mutant = (cst.Module([f]).code.strip() for f in funcs)
    return (orig, mutant) if orig != mutant else None


def pin_of(name: str) -> str | None:
    """A mutant's fingerprint: a hash of its function before and after the mutation, so
    that a change anywhere in the function (not only on the mutated line) unpins it."""
    funcs = mutant_functions(name)
    if funcs is None:
        return None
    return hashlib.sha256("\n\0\n".join(funcs).encode()).hexdigest()[:12]


def diff_of(name: str) -> str:
    funcs = mutant_functions(name)
    if funcs is None:
        return "(no such mutant)"
    orig, mutant = funcs
    return "\n".join(difflib.unified_diff(orig.split("\n"), mutant.split("\n"), lineterm="", n=1))


def check_equivalent(equivalent: dict[str, Entry], modules: set[str], pin=pin_of) -> list[str]:
    """What is wrong with the equivalent list for ``modules``: entries whose mutant no
    longer exists, whose function changed since the reason was written, or not pinned."""
    problems = []
    for name, entry in sorted(equivalent.items()):
        if module_of(name) not in modules:
            continue
        now = pin(name)
        if now is None:
            problems.append(f"stale: {name} names no mutant of today's code: drop the line")
        elif not entry.pin:
            problems.append(f"unpinned: {name}: review its diff, then --pin")
        elif entry.pin != now:
            problems.append(
                f"changed: {name}'s function changed since its reason was written "
                f"(pin {entry.pin}, now {now}): review it (mutmut show {name}), then re-pin"
            )
    return problems


def score(statuses: dict[str, str], equivalent: dict[str, Entry]) -> dict[str, Counter]:
    """Per module: killed, equivalent, survived (unreached included) and the statuses."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for name, status in statuses.items():
        c = counts[module_of(name)]
        if status == "survived" and name in equivalent:
            c["equivalent"] += 1
        elif status in KILLED:
            c["killed"] += 1
        else:
            c["survived"] += 1
            if status != "survived":
                c["unreached"] += 1
    return counts


def percent(c: Counter) -> float:
    scored = c["killed"] + c["survived"]
    return 100.0 * c["killed"] / scored if scored else 100.0


def scores_json(counts: dict[str, Counter]) -> dict:
    """Per module and over all: mutants, killed, equivalent, survived (unreached among
    them) and the score in percent, as written to :data:`SCORES`."""
    total = Counter()
    for c in counts.values():
        total.update(c)
    keys = ("killed", "equivalent", "survived", "unreached")
    return {
        mod: {"mutants": c["killed"] + c["equivalent"] + c["survived"]}
        | {k: c[k] for k in keys}
        | {"score": round(percent(c), 1)}
        for mod, c in [*sorted(counts.items()), ("all", total)]
    }


def report(
    statuses: dict[str, str],
    patterns: list[str],
    min_score: float,
    pin=pin_of,
    out=print,
    write: Path | None = None,
) -> int:
    chosen = {k: v for k, v in statuses.items() if any(fnmatch.fnmatch(k, p) for p in patterns)}
    equivalent = read_equivalent()
    counts = score(chosen, equivalent)
    if write is not None:  # the table the docs show, from this run
        write.write_text(json.dumps(scores_json(counts), indent=1) + "\n")
    out(
        f"{'module':28} {'mutants':>8} {'killed':>7} {'equiv.':>7} {'survived':>9}"
        f" {'unreached':>9} {'score':>6}"
    )
    total = Counter()
    for mod, c in sorted(counts.items()):
        total.update(c)
        row = f"{c['killed']:7d} {c['equivalent']:7d} {c['survived']:9d} {c['unreached']:9d}"
        n = c["killed"] + c["equivalent"] + c["survived"]
        out(f"{mod:28} {n:8d} {row} {percent(c):5.1f}%")
    n = total["killed"] + total["equivalent"] + total["survived"]
    row = f"{total['killed']:7d} {total['equivalent']:7d} {total['survived']:9d}"
    out(f"{'all':28} {n:8d} {row} {total['unreached']:9d} {percent(total):5.1f}%")
    problems = check_equivalent(equivalent, set(counts), pin)
    problems += [
        f"killed: {name} is listed as equivalent but a test kills it ({chosen[name]}): "
        "drop the line"
        for name in sorted(equivalent)
        if name in chosen and chosen[name] in KILLED
    ]
    left = [
        f"{status}: {name}   (mutmut show {name})"
        for name, status in sorted(chosen.items())
        if status not in KILLED and name not in equivalent
    ]
    for line in problems + left:
        out(line)
    low = sorted(mod for mod, c in counts.items() if percent(c) < min_score)
    if problems or left or low:
        out(
            f"{len(left)} survivor(s) neither killed nor explained, {len(problems)} problem(s) "
            f"with {EQUIVALENT.name}; modules under {min_score:.0f}%: {low or 'none'}"
        )
        return 1
    return 0


def results() -> dict[str, str]:
    """Every mutant of the last run and its status (killed, survived, timeout ...)."""
    out = subprocess.run(
        [MUTMUT, "results", "--all", "true"], cwd=REPO, capture_output=True, text=True
    )
    if out.returncode:
        sys.exit(f"error: mutmut results failed: {out.stderr.strip().splitlines()[-1:]}")
    return {m.group(1): m.group(2) for m in map(LINE.match, out.stdout.splitlines()) if m}


def generate() -> None:
    """Generate ``mutants/`` with mutmut's own mutator, running no test (for --review and
    --pin without a run of an hour)."""
    from mutmut import __main__ as mm

    os.chdir(REPO)
    mm.set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.setup_source_paths()
    mm.create_mutants(os.cpu_count() or 1)


def add_slow_tests(seconds: float, path: Path | None = None) -> list[str]:
    """Add to ``tools/mutation_slow_tests.txt`` every test that took more than ``seconds``
    in mutmut's last stats run (``tests/mutation_speed.py`` leaves them out); returns the
    added ones. Listed tests stay listed (they are not in the stats of later runs)."""
    path = path or REPO / "tools" / "mutation_slow_tests.txt"
    stats = json.loads((REPO / "mutants" / "mutmut-stats.json").read_text())
    text = path.read_text() if path.is_file() else ""
    added = sorted(  # a test named anywhere in the file, comments too, is left be
        t for t, d in stats["duration_by_test"].items() if d > seconds and t not in text
    )
    lines = [f"{t}  # {stats['duration_by_test'][t]:.0f} s" for t in added]
    if added:
        path.write_text(text + "".join(f"{line}\n" for line in lines))
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", help="mutant name globs (default: TARGETS)")
    ap.add_argument("--report", action="store_true", help="report the last run, run nothing")
    ap.add_argument("--generate", action="store_true", help="only generate mutants/, no test")
    ap.add_argument(
        "--review", action="store_true", help="print each equivalent entry's diff and reason"
    )
    ap.add_argument("--pin", action="store_true", help="pin the entries that have no pin")
    ap.add_argument("--min-score", type=float, default=90.0, help="per module, in percent")
    ap.add_argument(
        "--write", action="store_true", help=f"write the per-module table to {SCORES.name}"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--slow-tests",
        type=float,
        metavar="SECONDS",
        help="list the tests slower than this in the last stats run as left out, run nothing",
    )
    args = ap.parse_args(argv)
    if args.slow_tests is not None:
        added = add_slow_tests(args.slow_tests)
        print(f"{len(added)} test(s) added to mutation_slow_tests.txt: {added}")
        return 0
    patterns = args.patterns or TARGETS
    if args.generate:
        generate()
    if args.review or args.pin:
        chosen = [n for n in read_equivalent() if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if args.review:
            for name in chosen:
                entry = read_equivalent()[name]
                print(f"=== {name}  pin {entry.pin or '-'} now {pin_of(name)}\n# {entry.why}")
                print(diff_of(name))
        if args.pin:
            pins = {n: p for n in chosen if (p := pin_of(n)) is not None}
            print(f"pinned {write_pins(pins)} entries of {EQUIVALENT.name}")
        return 0
    if args.generate:
        return 0
    if not args.report:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per mutant process
        cmd = [MUTMUT, "run", "--max-children", str(args.jobs), *patterns]
        done = subprocess.run(cmd, cwd=REPO, env=env)
        if done.returncode:
            return done.returncode
    return report(results(), patterns, args.min_score, write=SCORES if args.write else None)


if __name__ == "__main__":
    sys.exit(main())
