"""The documentation: the site builds with `mkdocs build --strict` (broken links, anchors,
pages missing from the nav and unfillable placeholders fail), it opens offline, every
figure on a page comes from a placeholder filled from a committed file, and the README
stays short.

The figure rule (docs/_hooks/placeholders.py, ``hand_typed_figures``): outside code, a
number with a decimal point, a percentage, a ratio such as ``12x``, a quantity with a unit
of time, rate or size, or a table cell that is only a number, is a figure, and a page may
show one only through a placeholder. Integers in prose (counts, equation and section
numbers) and values written as code (settings a reader types) are not figures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("mkdocs", reason="mkdocs is in the [dev] extra: pip install -e '.[dev]'")

DOCS = REPO / "docs"
HOOKS = DOCS / "_hooks"
sys.path.insert(0, str(HOOKS))
import placeholders  # noqa: E402

README_MAX_LINES = 250


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if HOOKS not in p.parents)


def _build(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the hook puts this checkout first
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = _build(REPO / "mkdocs.yml", out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _text(html: Path) -> str:
    """The visible text of a built page, roughly: tags dropped, entities of numbers kept."""
    return re.sub(r"<[^>]+>", " ", html.read_text(encoding="utf-8"))


def test_the_site_builds_in_strict_mode_with_every_page(site):
    built = {p.relative_to(site).with_suffix(".md") for p in site.rglob("*.html")}
    for page in _pages():
        assert page.relative_to(DOCS) in built, f"{page} was not built"


def test_the_references_are_generated_from_the_code(site):
    from flows.cli import build_parser
    from flows.params import params_model

    cli = _text(site / "reference" / "cli.html")
    # every command of the parser, and an argument's help as the parser has it
    for action in build_parser()._actions:
        for name in getattr(action, "choices", None) or {}:
            assert f"vse {name}" in cli, name
    assert "output folder, e.g. data/demo" in cli  # vse demo-data --out's help

    params = _text(site / "reference" / "params.html")
    for name in params_model().model_fields:
        assert re.search(rf"\b{name.rstrip('_')}\b", params), name
    # a field's description is the comment beside it in its class (models/mvvse.py)
    assert "K visual aggregators" in params

    stages = _text(site / "reference" / "stages.html")
    for stage in ("demo-data", "regions", "train@mvvse", "evaluate@univse", "report"):
        assert stage in stages, stage


def test_the_figures_are_those_of_their_source_file(site):
    source = json.loads((REPO / "tests/data/captions_gold_scores.json").read_text())
    page = _text(site / "explanation" / "language.html")
    for kind, scores in source.items():
        row = re.search(rf"{kind}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", page)
        assert row, f"no row for {kind}"
        shown = [float(v) for v in row.groups()]
        wanted = [round(scores[m], 3) for m in ("precision", "recall", "f1")]
        assert shown == wanted, (kind, shown, wanted)


def test_the_site_opens_offline(site):
    """No script, stylesheet, font or image from another host (Material's fonts are off and
    its search is built in); no mermaid block, whose renderer Material would fetch."""
    external = re.compile(
        r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//"""
    )
    for html in site.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        assert not external.search(text), f"{html}: {external.search(text).group(0)}"
        assert 'class="mermaid"' not in text, html


def test_no_figure_is_typed_by_hand():
    found = [
        f"{path.relative_to(REPO)}:{line}: {figure}"
        for path in [*_pages(), REPO / "README.md"]
        for line, figure in placeholders.hand_typed_figures(path.read_text(encoding="utf-8"))
    ]
    assert not found, "figures typed by hand (use a placeholder):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "The rules score F1 0.996 on objects.",
        "| regions | 54.1 |",
        "| model | rsum |\n|---|---|\n| VSE++ | 165 |",
        "a speed-up of 212x over the loop",
        "it covers 100% of the boxes",
        "the whole DAG takes 10 minutes",
        "writes at 567 MB/s",
        "a step takes 16 s",
    ],
)
def test_the_rule_finds_a_hand_typed_figure(text):
    assert placeholders.hand_typed_figures(text), text


@pytest.mark.parametrize(
    "text",
    [
        'F1 {{ fig("tests/data/captions_gold_scores.json", "objects.f1", ".3f") }}',
        "eq. 9-10, sec. 4.2, sec. 4.1.1 and Fig. 2 of the paper",
        "a 7x7 grid of 2048 channels, 36 regions, five captions",
        "set `lr: 1.6192e-5` and `dropout: 0.15`",
        "```yaml\nmargin: 0.2\n```",
        "| `per_caption` | `int` |",
    ],
)
def test_the_rule_lets_other_numbers_pass(text):
    assert not placeholders.hand_typed_figures(text), text


def test_a_placeholder_is_filled_from_its_file():
    scores = json.loads((REPO / "tests/data/captions_gold_scores.json").read_text())
    text = 'F1 {{ fig("tests/data/captions_gold_scores.json", "relations.f1", ".3f") }}.'
    assert placeholders.expand(text) == f"F1 {scores['relations']['f1']:.3f}."
    assert placeholders.expand('`{{ fig("nowhere.json", "x") }}`') == (
        '`{{ fig("nowhere.json", "x") }}`'  # code is shown as written
    )


@pytest.mark.parametrize(
    "placeholder, message",
    [
        ('{{ fig("tests/data/captions_gold_scores.json", "objects.f2") }}', "no key"),
        ('{{ fig("tests/data/no_such_results.json", "objects.f1") }}', "no such file"),
        ('{{ param("models.mvvse.no_such_key") }}', "no key"),
        ('{{ figure("tests/data/captions_gold_scores.json", "objects.f1") }}', "unknown"),
    ],
)
def test_an_unfillable_placeholder_fails_the_build(tmp_path, placeholder, message):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# A page\n\nThe figure: {placeholder}\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        textwrap.dedent(
            f"""\
            site_name: test
            docs_dir: {docs}
            strict: true
            hooks:
              - {HOOKS / "placeholders.py"}
            """
        )
    )
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "index.md" in output and placeholder in output and message in output, output


def test_the_readme_is_short_and_keeps_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"```bash\n(.*?)```", quick, re.S).group(1).splitlines()
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", (REPO / "Makefile").read_text(), re.M), target


def test_no_history_in_the_user_docs():
    """Rounds and issues belong to HISTORY.md, not to the pages a user reads."""
    history = re.compile(r"\b(?:issue|round)\s+\d+\b|\bbefore this (?:split|round)\b", re.I)
    for path in [*_pages(), REPO / "README.md"]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not history.search(line), f"{path.relative_to(REPO)}:{number}: {line}"
