"""No silent skip in CI: with ``VSE_STRICT_SKIPS`` set (``.ci/run`` sets it), a skipped
test whose reason is not on :data:`ALLOWED` makes the session fail, and each one is listed
in the summary. Without the variable a skip is just a skip (a developer's machine without
Chromium still passes ``make test``).

``VSE_STRICT_SKIPS=1``: the allow-list as it is. ``VSE_STRICT_SKIPS=cuda``: on a GPU
machine, where a test skipped for want of CUDA is a failure too.

Loaded by ``tests/conftest.py``; a plugin module of its own so that its test can load it
into a ``pytester`` session.
"""

from __future__ import annotations

import os
import re

import pytest

CUDA = "needs a CUDA GPU"  # the reason of every CUDA-only test's skipif
# The only skips a CI run may have: reason pattern -> why it may skip there. Nothing else:
# CI builds detectron2 (.ci/run) and installs Chromium, so their tests run there.
ALLOWED = {
    rf"^{CUDA}$": "CI runs on CPU machines; run them on a GPU with `pytest -m cuda`",
}


def allowed(reason: str, strict: str) -> bool:
    patterns = [p for p in ALLOWED if not (strict == "cuda" and CUDA in p)]
    return any(re.search(p, reason) for p in patterns)


def reason_of(report) -> str:
    """``Skipped: why`` (a skip during setup or the call, or of a whole module at
    collection) -> ``why``."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class StrictSkips:
    def __init__(self, strict: str):
        self.strict = strict
        self.unexpected: list[tuple[str, str]] = []  # (test or file, reason)

    def _check(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = reason_of(report)
            if not allowed(reason, self.strict):
                self.unexpected.append((report.nodeid or str(report.fspath), reason))

    def pytest_runtest_logreport(self, report) -> None:
        self._check(report)

    def pytest_collectreport(self, report) -> None:
        self._check(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        if self.unexpected and session.exitstatus in (pytest.ExitCode.OK, 5):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("skips not on the allow-list (VSE_STRICT_SKIPS)", red=True)
        for where, reason in self.unexpected:
            terminalreporter.line(f"SKIPPED {where}: {reason}", red=True)
        terminalreporter.line(
            f"{len(self.unexpected)} test(s) skipped in a strict run: install what they "
            "need, or add the reason to ALLOWED in tests/strict_skips.py",
            red=True,
        )


def pytest_configure(config) -> None:
    strict = os.environ.get("VSE_STRICT_SKIPS", "")
    if strict not in ("", "0"):
        config.pluginmanager.register(StrictSkips(strict), "vse_strict_skips")
    config.addinivalue_line("markers", f"cuda: a CUDA-only test (skipped with {CUDA!r})")


def pytest_collection_modifyitems(items) -> None:
    """Mark every test that skips without CUDA ``cuda``: ``pytest -m cuda`` runs them all."""
    for item in items:
        if any(m.kwargs.get("reason") == CUDA for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
