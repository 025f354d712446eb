"""Reference pages generated from the code, at build time (nothing generated is committed).

- :func:`cli_reference`: every ``vse`` command, from the argument parser
  (:func:`flows.cli.build_parser`): usage, description, each argument with its default and
  help, and whether a path is a stage input or output (``path_in`` / ``path_out``).
- :func:`params_reference`: every section of ``params.yaml``, from the typed sections
  (:func:`flows.params.params_model`): key, type and bounds, the code's default, the value
  in the committed ``params.yaml``, and the description. Descriptions are a field's
  ``Field(description=...)`` when it has one, else the comments written beside it in the
  class body: the comment at the end of the field's line(s) and the block of comment lines
  directly above it, read with :mod:`tokenize` from the defining class's source (walking
  the class's bases, so inherited fields keep their comments).
- :func:`stages_reference`: every stage of ``dvc.yaml`` as DVC resolves it (``foreach``
  expanded): its command, data inputs, outputs and params sections.
- :func:`docstring`: a module's docstring, read with :mod:`ast` (nothing is imported).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def cell(text: Any) -> str:
    """Text made safe for one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: Any) -> str:
    """An inline code span holding ``text`` (backticks inside it fenced by more)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def anchor(words: str) -> str:
    """The anchor MkDocs gives a heading of ``words`` (toc's default slugify)."""
    slug = re.sub(r"[^\w\s-]", "", words).strip().lower()
    return re.sub(r"[-\s]+", "-", slug)


# ----------------------------------------------------------------------------- CLI


def _leaves(parser: argparse.ArgumentParser, words: list[str], help: str = ""):
    """(words, help, parser) for every command that runs, depth first, in the parser's
    order; ``help`` is the one line the command's parent lists it with."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, help, parser
        return
    helps = {a.dest: a.help or "" for a in subs[0]._choices_actions}
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, [*words, name], helps.get(name, ""))


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += f" {action.metavar or action.dest.upper()}"
        else:
            name = action.metavar or action.dest
        if action.nargs in ("*", "+"):
            name += " ..."
        role = {"in": "input", "out": "output"}.get(getattr(action, "role", None), "")
        need = "required" if action.required or not action.option_strings else ""
        kind = ", ".join(w for w in (need, role) if w)
        default = action.default
        shown = (
            ""
            if default in (None, False, argparse.SUPPRESS) or action.nargs == 0
            else code(default)
        )
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            choices = "one of " + ", ".join(code(c) for c in action.choices)
        else:
            choices = ""
        text = "; ".join(t for t in (_help(parser, action), choices) if t)
        rows.append(f"| {code(name)} | {cell(kind)} | {cell(shown)} | {cell(text)} |")
    return rows


def cli_reference() -> str:
    """Markdown for every ``vse`` command."""
    from flows.cli import build_parser

    root = build_parser()
    leaves = list(_leaves(root, []))
    out = [
        "Generated from the `vse` argument parser (`flows/cli.py`, one module per command in "
        "`flows/commands/`) each time the documentation is built.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for words, help, _ in leaves:
        title = "vse " + " ".join(words)
        out.append(f"| [{code(title)}](#{anchor(title)}) | {cell(help)} |")
    out += ["", "## Options of every command", "", *_argument_table(root, top=True)]
    for words, help, parser in leaves:
        title = "vse " + " ".join(words)
        usage = parser.format_usage().removeprefix("usage: ").strip()
        usage = re.sub(r"\n\s+", "\n    ", usage)
        out += ["", f"## {title}", ""]
        if help:
            out += [help[0].upper() + help[1:] + ("" if help.endswith(".") else "."), ""]
        if parser.description and parser.description != help:
            out += [parser.description, ""]
        out += ["```text", usage, "```", "", *_argument_table(parser)]
    return "\n".join(out) + "\n"


def _argument_table(parser: argparse.ArgumentParser, top: bool = False) -> list[str]:
    rows = _argument_rows(parser)
    if top:
        rows = [r for r in rows if not r.startswith("| `COMMAND`")]
    if not rows:
        return []
    return ["| argument | | default | description |", "|---|---|---|---|", *rows]


# -------------------------------------------------------------------------- params


def _class_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments beside it in ``cls``'s own body (not its bases')."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    body = ast.parse(source).body[0].body
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above = []
        n = node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        text = " ".join(trailing or above).strip()  # a comment above a commented field
        # heads a group of fields rather than describing this one
        if text:
            found[node.target.id] = text
    return found


def _comment(model: type, name: str) -> str:
    for cls in model.__mro__:
        if name in cls.__dict__.get("__annotations__", {}):
            return _class_comments(cls).get(name, "")
    return ""


def _typename(annotation: Any) -> str:
    """A type as a reader of params.yaml thinks of it, in markdown: `int`, list of
    `float`, `str` or `null`, one of `"a"`, `"b"`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return code("null")
    if origin is typing.Literal:
        return "one of " + ", ".join(code(json.dumps(a)) for a in args)
    if origin is typing.Annotated:
        return _typename(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_typename(a) for a in args)
    if origin in (list, tuple, set):
        return f"list of {_typename(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_typename(args[0])} to {_typename(args[1])}" if args else "mapping"
    if annotation is typing.Any:
        return "any"
    return code(getattr(annotation, "__name__", str(annotation)))


def _type(annotation: Any) -> str:
    return _typename(annotation)


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="))


def _bounds(field: Any) -> str:
    found = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def _plain(value: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _value(value: Any) -> str:
    return code(json.dumps(_plain(value), default=str))


def _is_section(annotation: Any) -> bool:
    from infra.config import Section

    return isinstance(annotation, type) and issubclass(annotation, Section)


def _section(name: str, model: type, given: Any, level: int) -> list[str]:
    """Markdown for one section (and its subsections) of params.yaml."""
    where = f"`{model.__module__}.{model.__qualname__}`"
    out = [f"{'#' * level} {name}", ""]
    doc = inspect.getdoc(model)
    if doc and model.__module__ != "pydantic.main":
        out += [_rst(" ".join(doc.split("\n\n")[0].split())), ""]
    out += [f"Defined by {where}.", ""]
    rows, subsections = [], []
    for key, field in model.model_fields.items():
        shown = field.alias or key
        if _is_section(field.annotation):
            sub = given.get(shown, {}) if isinstance(given, dict) else {}
            subsections.append((f"{name}.{shown}", field.annotation, sub))
            continue
        default = field.get_default(call_default_factory=True)
        demo = given.get(shown, default) if isinstance(given, dict) else default
        in_file = _value(demo) if _plain(demo) != _plain(default) else "same"
        description = field.description or _comment(model, key)
        bounds = _bounds(field)
        rows.append(
            f"| {code(shown)} | {_type(field.annotation)}{' ' + cell(bounds) if bounds else ''}"
            f" | {cell(_value(default))} | {cell(in_file)} | {cell(description)} |"
        )
    if rows:
        out += [
            "| key | type | default | `params.yaml` | description |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    for sub_name, sub_model, sub_given in subsections:
        out += _section(sub_name, sub_model, sub_given, level + 1)
    return out


def params_reference() -> str:
    """Markdown for every section of params.yaml."""
    import yaml

    from flows.params import params_model

    given = yaml.safe_load((REPO / "params.yaml").read_text()) or {}
    model = params_model()
    names = sorted(f.alias or k for k, f in model.model_fields.items())
    out = [
        "Generated from the typed sections of `params.yaml` (`flows/params.py` composes "
        "them; each is defined next to the code that reads it) each time the documentation "
        "is built. *default* is the code's; *`params.yaml`* is the value in the repository's "
        "`params.yaml` (the demo's) where it differs. Descriptions are the comments written "
        "beside each field in its class.",
        "",
        "Sections: " + ", ".join(f"[{code(n)}](#{anchor(n)})" for n in names) + ".",
        "",
    ]
    by_alias = {f.alias or k: f for k, f in model.model_fields.items()}
    for name in names:
        out += _section(name, by_alias[name].annotation, given.get(name, {}), 2)
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------- stages


def _short(path: str) -> str:
    return code(path)


def stages_reference() -> str:
    """Markdown for every stage of dvc.yaml, as DVC resolves it (for a page beside
    ``cli.md``: commands link to their entries there)."""
    from dvc.repo import Repo

    from flows.cli import build_parser

    commands = {"vse " + " ".join(words) for words, _, _ in _leaves(build_parser(), [])}
    with Repo(str(REPO)) as repo:
        stages = list(repo.index.stages)
        rows = []
        for stage in stages:
            data = [d.def_path for d in stage.deps if not d.def_path.endswith(".py")]
            data = [d for d in data if d != "params.yaml"]
            sections = sorted(
                {str(p).split(".")[0] for d in stage.deps if hasattr(d, "params") for p in d.params}
            )
            words = []
            for word in (stage.cmd or "").split():
                if word.startswith("-") or "/" in word or "." in word:
                    break
                words.append(word)
            shown = " ".join(words)
            while words and " ".join(words) not in commands:
                words.pop()  # `vse evaluate mvvse`: command `vse evaluate`, argument mvvse
            command = " ".join(words)
            rows.append(
                f"| {code(stage.name)} | [{code(shown)}](cli.md#{anchor(command)}) | "
                f"{'<br>'.join(_short(d) for d in data)} | "
                f"{'<br>'.join(_short(o.def_path) for o in stage.outs)} | "
                f"{', '.join(code(s) for s in sections)} |"
            )
    return (
        "Generated from `dvc.yaml` as DVC resolves it (one row per stage, `foreach` "
        "expanded) each time the documentation is built. Code dependencies are left out.\n\n"
        "| stage | command | reads | writes | params |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


# ------------------------------------------------------------------------ docstrings


def docstring(module: str) -> str:
    """The docstring of ``module`` (a dotted name of this repository), as markdown:
    reStructuredText's double backticks become code spans."""
    path = REPO / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if text is None:
        raise KeyError(f"{module}: no docstring")
    return _rst(text) + "\n"


def _rst(text: str) -> str:
    """reStructuredText's inline code and roles as markdown code spans."""
    text = re.sub(r":(?:mod|func|class|meth|attr|data):`~?\.?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")
