"""Typed, strict config sections and readable validation errors.

Every section of ``params.yaml`` is a :class:`Section`: unknown keys, wrong types and
non-finite floats (``.inf``, ``.nan``) are rejected, and :func:`format_errors` turns
pydantic's report into one line per problem that names the full key path
(``models.mvvse.lamda: unknown key, did you mean lambda_``).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A random seed: numpy's generators want one that is not negative, 32 bits is everyone's.
Seed = Annotated[int, Field(ge=0, lt=2**32)]


class Section(BaseModel):
    """Base of every config section: frozen, no extra keys, no silent type coercion, floats
    finite. Every number has the bounds that make sense (``tests/test_config.py`` checks
    that each one has a lower bound and refuses values outside its bounds)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class UserError(RuntimeError):
    """A failure the user can fix; the message names the file, key or item and what to do."""


def one_line(detail, limit: int = 160) -> str:
    """``detail`` (an exception or text) as one line of at most ``limit`` characters, to
    quote inside a one-line error message."""
    return " ".join(str(detail).split())[:limit]


class ConfigError(ValueError):
    """A config file failed validation; the message lists every problem by key path."""


def require_extra(module: str, extra: str, feature: str):
    """Import ``module``, installed by the package extra ``extra``; if it is missing, a
    one-line error naming the extra (``pip install 'vse-pipeline[dask]'``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{feature} needs the [{extra}] extra: pip install -e '.[{extra}]' in the repository"
        ) from None


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names (aliases included) of the section at ``loc``, for did-you-mean hints."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = getattr(field, "annotation", None) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    fields = model.model_fields.items()
    return [n for name, field in fields for n in (name, field.alias) if n]


def _key(part: Any) -> str:
    """A key of a key path as written, quoted when it would not read as one (empty,
    spaces, line breaks)."""
    text = str(part)
    return text if text and text.isprintable() and text.strip() == text else repr(part)


def format_errors(error: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line per problem: ``<source>: <key.path>: <what is wrong>``."""
    lines = []
    for item in error.errors():
        loc = tuple(item["loc"])
        path = ".".join(_key(part) for part in loc) or "<root>"
        if item["type"] == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
            message = "unknown key" + (f", did you mean {hint[0]}" if hint else "")
            if known and not hint:
                message += f" (known keys: {', '.join(sorted(set(known)))})"
        elif item["type"] == "missing":
            message = "missing key"
        elif item["type"] == "value_error" and isinstance(item.get("input"), dict):
            message = str(item["ctx"]["error"])  # a whole section's check names its keys
        else:
            message = f"{' '.join(str(item['msg']).split())} (got {item.get('input')!r:.200})"
        lines.append(f"{source}: {path}: {message}")
    return "\n".join(lines)
