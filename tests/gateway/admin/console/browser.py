"""The system Chromium, headless, driven by Selenium through Debian's chromedriver.

Nothing is downloaded: where `chromium`, `chromedriver` or the selenium package is missing, the
browser tests are skipped with the reason (`make test` installs both as root: `make system-deps`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

#: screenshots of each page, kept after the run (git-ignored)
ARTIFACTS = (
    Path(os.environ.get("FLEETGATE_TEST_ARTIFACTS", Path(__file__).parents[4] / "test-artifacts")) / "console"
)
_BINARIES = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> tuple[str, str] | None:
    binary = next((p for p in map(shutil.which, _BINARIES) if p), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def skip_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if _browser() is None:
        return "no chromium + chromedriver on PATH (apt-get install chromium chromium-driver, or `make system-deps` as root)"
    return None


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A headless Chromium with a fresh profile; its console log is kept for CSP checks."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = _browser()
    assert found is not None
    binary, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def require_browser() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
