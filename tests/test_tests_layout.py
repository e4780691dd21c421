"""`tests/` mirrors the packages (docs/testing.md, "Where tests live"): a folder of tests names the
package folder it tests, or is one of the few suites documented as spanning several packages."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGES = ("backends", "gateway", "policies", "router")
#: suites that span packages, with why (docs/testing.md says the same)
CROSS_CUTTING = {
    "tenancy": "gateway processes end to end: keys, limits, budgets, replicas on one store, workers",
    "deploy": "the repository's deploy/ folder and Makefile, not a Python package",
    "backends/tensor_runtimes": "every tensor runtime over one model in each format: contract, parity",
}


def _test_folders() -> list[str]:
    """Every folder under tests/ that holds tests or is a package of them."""
    marks = [*TESTS.rglob("__init__.py"), *TESTS.rglob("test_*.py")]
    return sorted({str(f.parent.relative_to(TESTS)) for f in marks if f.parent != TESTS and "__pycache__" not in f.parts})


def test_every_test_folder_mirrors_a_package_or_is_a_documented_suite() -> None:
    strays = []
    for folder in _test_folders():
        top = folder.split("/")[0]
        within_suite = any(folder == s or folder.startswith(f"{s}/") for s in CROSS_CUTTING)
        if not within_suite and (top not in PACKAGES or not (ROOT / folder).is_dir()):
            strays.append(folder)
    assert not strays, f"test folders that mirror no package folder: {strays} (see docs/testing.md)"


def test_the_documented_suites_exist_and_are_documented() -> None:
    guide = (ROOT / "docs" / "testing.md").read_text()
    for suite in CROSS_CUTTING:
        assert (TESTS / suite).is_dir() and f"tests/{suite}" in guide, suite
