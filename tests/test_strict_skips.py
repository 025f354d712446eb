"""The strict-skip rule of CI (tests/strict_skips.py), in pytest sessions of its own: with
VSE_STRICT_SKIPS set, a skip not on the allow-list fails the session and is named; one on
the list (only the CUDA-only tests) does not; without the variable a skip is only a skip."""

import pytest
from strict_skips import ALLOWED, CUDA

TESTS = """
import pytest

def test_runs():
    assert True

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu():
    pass
"""
DETECTRON2 = """
import pytest

def test_parity():
    pytest.skip("detectron2 is not installed (optional backend)")  # test_butd's reason

def test_other_reason():
    pytest.skip("could not import 'detectron2': the detectron2 backend is optional")
"""
BROWSER = """
import pytest

def test_browser():
    pytest.skip("headless Chromium is not installed")
"""
MODULE = """
import pytest
pytest.importorskip("no_such_module_here")

def test_s3():
    pass
"""


@pytest.fixture
def session(pytester, monkeypatch):
    pytester.makeconftest(
        "from strict_skips import pytest_collection_modifyitems, pytest_configure  # noqa"
    )

    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # hypothesis, zarr ...: not needed

    def run(strict: str | None, *args: str, **files):
        if strict is None:
            monkeypatch.delenv("VSE_STRICT_SKIPS", raising=False)
        else:
            monkeypatch.setenv("VSE_STRICT_SKIPS", strict)
        pytester.makepyfile(**files)
        return pytester.runpytest("-p", "no:cacheprovider", *args)

    return run


def test_only_the_cuda_only_tests_may_skip_in_ci():
    assert list(ALLOWED) == [f"^{CUDA}$"]


def test_allowed_skips_pass_a_strict_run(session):
    result = session("1", test_allowed=TESTS)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == 0
    assert "not on the allow-list" not in result.stdout.str()


def test_a_skip_not_on_the_list_fails_a_strict_run_and_is_named(session):
    result = session("1", test_allowed=TESTS, test_browser=BROWSER)
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*skips not on the allow-list (VSE_STRICT_SKIPS)*",
            "SKIPPED test_browser.py::test_browser: headless Chromium is not installed",
            "1 test(s) skipped in a strict run*",
        ]
    )
    assert "test_gpu:" not in result.stdout.str()


def test_a_detectron2_skip_fails_a_strict_run(session):
    """CI builds detectron2, so its parity test may not skip there, whatever the reason."""
    result = session("1", test_d2=DETECTRON2, test_allowed=TESTS)
    result.assert_outcomes(passed=1, skipped=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "SKIPPED test_d2.py::test_parity: detectron2 is not installed (optional backend)",
            "SKIPPED test_d2.py::test_other_reason: could not import 'detectron2'*",
            "2 test(s) skipped in a strict run*",
        ]
    )


def test_a_module_skipped_at_collection_fails_a_strict_run(session):
    result = session("1", test_module=MODULE)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["SKIPPED test_module.py*no_such_module_here*"])


def test_without_the_variable_a_skip_is_only_a_skip(session):
    result = session(
        None, test_allowed=TESTS, test_browser=BROWSER, test_module=MODULE, test_d2=DETECTRON2
    )
    assert result.ret == 0
    assert "not on the allow-list" not in result.stdout.str()


def test_on_a_gpu_machine_a_cuda_skip_fails_too(session):
    result = session("cuda", test_allowed=TESTS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["SKIPPED test_allowed.py::test_gpu: needs a CUDA GPU"])


def test_cuda_only_tests_carry_the_cuda_marker(session):
    """``pytest -m cuda`` selects every test that skips without CUDA, and only those."""
    result = session(None, "-m", "cuda", "--collect-only", "-q", test_allowed=TESTS)
    assert [line for line in result.outlines if "::" in line] == ["test_allowed.py::test_gpu"]
