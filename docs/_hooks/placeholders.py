"""MkDocs hook: placeholders that fill the pages from result files and from the code.

A page writes ``{{ name(arguments) }}`` where a figure or a generated reference goes; the
build replaces it, and a placeholder that names a missing file, key or module stops the
build with one line naming the page and the placeholder. Arguments are Python literals
(nothing is evaluated). Placeholders inside code (fenced blocks, inline spans) are left as
written, so pages can show the syntax.

Figures, from a committed result file (JSON or YAML, a path from the repository root):

- ``{{ fig("tests/data/captions_gold_scores.json", "objects.f1", ".3f") }}``: one value,
  at a dotted key path (list items by index), formatted by ``format(value, spec)``.
- ``{{ table("FILE", rows=[...], columns=[...], fmt=".3f", header="kind") }}``: a
  markdown table of ``FILE[row][column]``; ``labels={"key": "shown"}`` renames either;
  ``rows="*"``: every top-level key of the file, in its order.

From the code:

- ``{{ param("models.mvvse.k") }}``: the code's default of a params.yaml key.
- ``{{ cli() }}``, ``{{ params() }}``, ``{{ stages() }}``: the generated references
  (:mod:`reference`); ``{{ docstring("models.vsepp") }}``: a module's docstring.

:func:`hand_typed_figures` is the rule ``tests/test_docs.py`` applies to every page: a
figure (a number with a decimal point, a percentage, a ratio such as ``12x``, a quantity
in a unit of time, rate or size, or a table cell that is only a number) may appear only
where a placeholder puts it.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(HERE)):  # this checkout's code first, then reference.py
    if path not in sys.path:
        sys.path.insert(0, path)

import reference  # noqa: E402

PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\((.*?)\)\s*\}\}", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)


class PlaceholderError(ValueError):
    """A placeholder that cannot be filled: unknown function, file or key."""


# ------------------------------------------------------------------------ figures


def _load(path: str) -> Any:
    file = REPO / path
    if not file.is_file():
        raise PlaceholderError(f"{path}: no such file in the repository")
    text = file.read_text(encoding="utf-8")
    if file.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text)
    return json.loads(text)


def _at(data: Any, key: str, path: str) -> Any:
    value = data
    for part in key.split(".") if key else []:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif (
            isinstance(value, list)
            and part.lstrip("-").isdigit()
            and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            raise PlaceholderError(f"{path}: no key {key!r} (missing at {part!r})")
    return value


def _format(value: Any, fmt: str | None) -> str:
    if fmt is None:
        return str(value)
    try:
        return format(value, fmt)
    except (TypeError, ValueError) as err:
        raise PlaceholderError(f"cannot format {value!r} with {fmt!r}: {err}") from None


def fig(path: str, key: str, fmt: str | None = None) -> str:
    return _format(_at(_load(path), key, path), fmt)


def table(
    path: str,
    rows: list[str] | str,
    columns: list[str],
    fmt: str | None = None,
    header: str = "",
    labels: dict[str, str] | None = None,
) -> str:
    data, labels = _load(path), labels or {}
    rows = list(data) if rows == "*" else rows
    out = [
        "| " + " | ".join([header] + [labels.get(c, c) for c in columns]) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row in rows:  # a top-level key as it is (it may hold dots), else a dotted path
        base = data[row] if isinstance(data, dict) and row in data else _at(data, row, path)
        cells = [_format(_at(base, c, path), fmt) for c in columns]
        out.append("| " + " | ".join([labels.get(row, row), *cells]) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------- code


def param(key: str) -> str:
    """The code's default of params.yaml key ``key`` (e.g. ``models.mvvse.k``)."""
    from flows.params import params_model

    model, value = params_model(), None
    for part in key.split("."):
        fields = {f.alias or k: f for k, f in model.model_fields.items()}
        if part not in fields:
            raise PlaceholderError(f"params.yaml has no key {key!r} (missing at {part!r})")
        value = fields[part].get_default(call_default_factory=True)
        model = fields[part].annotation
    value = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return value if isinstance(value, str) else json.dumps(value)


FUNCTIONS = {
    "fig": fig,
    "table": table,
    "param": param,
    "cli": reference.cli_reference,
    "params": reference.params_reference,
    "stages": reference.stages_reference,
    "docstring": reference.docstring,
}


def _call(name: str, arguments: str) -> str:
    if name not in FUNCTIONS:
        raise PlaceholderError(f"unknown placeholder {name!r} (known: {', '.join(FUNCTIONS)})")
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise PlaceholderError(f"arguments are not Python literals ({err})") from None
    try:
        return str(FUNCTIONS[name](*args, **kwargs))
    except PlaceholderError:
        raise
    except (TypeError, KeyError, FileNotFoundError) as err:
        raise PlaceholderError(str(err)) from None


def _outside_code(text: str, replace) -> str:
    """``replace`` applied to the parts of ``text`` that are not code."""
    protected = [(m.start(), m.end()) for m in FENCE.finditer(text)]
    out, last = [], 0
    for start, end in protected:
        out.append(_spans(text[last:start], replace))
        out.append(text[start:end])
        last = end
    out.append(_spans(text[last:], replace))
    return "".join(out)


def _spans(text: str, replace) -> str:
    out, last = [], 0
    for m in INLINE_CODE.finditer(text):
        out.append(replace(text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(replace(text[last:]))
    return "".join(out)


def expand(markdown: str, where: str = "page") -> str:
    """``markdown`` with every placeholder outside code replaced."""

    def fill(match: re.Match) -> str:
        try:
            return _call(match.group(1), match.group(2))
        except PlaceholderError as err:
            raise PlaceholderError(f"{where}: {match.group(0)}: {err}") from None

    return _outside_code(markdown, lambda part: PLACEHOLDER.sub(fill, part))


# ------------------------------------------------------------------- the figure rule

UNITS = (
    r"ms|µs|us|ns|s|sec|seconds?|min|minutes?|h|hours?|days?|"
    r"[kKMGT]i?B(?:/s)?|bytes|img/s|images/s|samples/s|captions/s|it/s|items/s"
)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.@])(?:"  # not part of a name: mAP@0.5, v2.1
    rf"\d[\d,]*\.\d+(?![\w.]*\d)"  # a decimal: 0.996, 54.1 (not a section number 4.1.1)
    rf"|{NUMBER}\s?%"  # a percentage
    rf"|{NUMBER}x(?!\w)"  # a ratio: 212x, 1.2x (not 7x7)
    rf"|{NUMBER}(?:\s?-\s?{NUMBER})?\s?(?:{UNITS})(?![\w/])"  # a quantity with a unit
    rf")"
)
# numbers that name a place in a paper or a version, not a figure
CITED = re.compile(r"(?:\b(?:eq|eqs|sec|fig|table|section|equation)s?\.?|§|\bv)\s*$", re.I)
BARE_NUMBER_CELL = re.compile(rf"^[~<>=≈±+\-−]*\s*{NUMBER}\s*$")


def _prose(markdown: str) -> str:
    """``markdown`` without code, placeholders, HTML comments and link targets, keeping
    line numbers (removed text becomes spaces)."""

    def blank(text: str) -> str:
        return re.sub(r"[^\n]", " ", text)

    text = re.sub(r"<!--.*?-->", lambda m: blank(m.group(0)), markdown, flags=re.S)
    text = FENCE.sub(lambda m: blank(m.group(0)), text)
    text = INLINE_CODE.sub(lambda m: blank(m.group(0)), text)
    text = PLACEHOLDER.sub(lambda m: blank(m.group(0)), text)
    return re.sub(r"\]\([^)]*\)", lambda m: "]" + blank(m.group(0)[1:]), text)


def hand_typed_figures(markdown: str) -> list[tuple[int, str]]:
    """(line number, figure) for every figure written by hand in ``markdown``."""
    found = []
    for number, line in enumerate(_prose(markdown).splitlines(), 1):
        for m in FIGURE.finditer(line):
            if not CITED.search(line[: m.start()]):
                found.append((number, m.group(0).strip()))
        if line.lstrip().startswith("|"):
            for part in line.strip().strip("|").split("|"):
                if BARE_NUMBER_CELL.match(part.strip()):
                    found.append((number, part.strip()))
    return found


# ----------------------------------------------------------------------- the hook


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown, page.file.src_uri)
    except PlaceholderError as err:
        raise PluginError(str(err)) from None
