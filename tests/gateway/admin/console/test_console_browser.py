"""The console in a real headless Chromium: sign in, create a key and use it, revoke it, change a
route weight through the reload path, watch live traffic move, names shown as text, tenant keys
refused. A screenshot of each page is saved under test-artifacts/console/."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN_KEY, create_key
from tests.gateway.admin.console.browser import chromium, require_browser, screenshot, skip_reason
from tests.gateway.admin.console.conftest import SCRIPT_TENANT, infer

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_browser()
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def _by(kind: str) -> Any:
    from selenium.webdriver.common.by import By

    return {"id": By.ID, "css": By.CSS_SELECTOR}[kind]


def _wait(driver: Any, condition: Any, timeout_s: float = 20) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the traffic page's script replaces its tables every few seconds: a row read mid-swap is read again
    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(driver, timeout_s, poll_frequency=0.2, ignored_exceptions=ignored).until(condition)


def _navigated(driver: Any, old_page_element: Any) -> None:
    """Wait until a click's new page has replaced the one `old_page_element` belonged to.

    Chromium may answer a question about an element of the page being replaced with "node does not
    belong to the document" (an inspector error, not a stale-element one): that too means it is gone.
    The callers then wait for the new page's URL, which is what proves the navigation."""
    from selenium.common.exceptions import WebDriverException

    def gone(_: Any) -> bool:
        try:
            old_page_element.is_enabled()
        except WebDriverException:  # stale, or the inspector's variant of it
            return True
        return False

    _wait(driver, gone)


def _sign_in(driver: Any, ui: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{ui}/")
    driver.find_element(_by("id"), "admin_key").send_keys(ADMIN_KEY)
    button = driver.find_element(_by("id"), "sign-in")
    button.click()
    _navigated(driver, button)
    _wait(driver, lambda d: d.current_url.endswith("/admin/ui/tenants"))


def _csp_violations(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]


def test_sign_in_and_every_page_shows_names_as_text(browser, console_gateway):
    browser.get(f"{console_gateway.ui}/tenants")
    assert browser.find_elements(_by("id"), "admin_key"), "a page without a session shows the sign-in form"
    screenshot(browser, "login")
    _sign_in(browser, console_gateway.ui)
    names = [e.text for e in browser.find_elements(_by("css"), "h2.tenant-name")]
    assert SCRIPT_TENANT in names  # the markup is shown as text, and never ran
    assert browser.title != "owned" and "Tenants" in browser.title
    screenshot(browser, "tenants")
    for page in ("keys", "models", "traffic", "audit"):
        link = browser.find_element(_by("id"), f"nav-{page}")
        link.click()
        _navigated(browser, link)
        _wait(browser, lambda d, page=page: d.current_url.endswith(f"/admin/ui/{page}"))
        screenshot(browser, page)
    assert _csp_violations(browser) == []  # the page's own script and style load under the CSP


def test_create_a_key_use_it_then_revoke_it(browser, console_gateway):
    _sign_in(browser, console_gateway.ui)
    browser.get(f"{console_gateway.ui}/keys")
    browser.find_element(_by("css"), "#tenant option[value='acme']").click()
    browser.find_element(_by("id"), "name").send_keys("from the browser")
    button = browser.find_element(_by("id"), "create-key")
    button.click()
    _navigated(browser, button)
    secret = _wait(browser, lambda d: d.find_element(_by("id"), "new-secret")).text
    screenshot(browser, "keys-created")
    assert secret.startswith("fg-") and secret not in browser.current_url
    assert infer(console_gateway.url, secret).status_code == 200

    key_id = secret.split("-")[1]
    browser.get(f"{console_gateway.ui}/keys")
    row = browser.find_element(_by("id"), f"key-{key_id}")
    assert "from the browser" in row.text and secret not in browser.page_source  # shown once
    button = browser.find_element(_by("id"), f"revoke-{key_id}")
    button.click()
    _wait(browser, lambda d: d.switch_to.alert).accept()  # the script asks first
    _navigated(browser, button)
    _wait(browser, lambda d: "revoked" in d.find_element(_by("id"), f"key-{key_id}").get_attribute("class"))
    screenshot(browser, "keys-revoked")
    _wait(browser, lambda _: infer(console_gateway.url, secret).status_code == 401, timeout_s=10)


def _route_cells(driver: Any, model: str, deployment: str) -> tuple[str, str]:
    row = driver.find_element(_by("css"), f"#model-{model} tr.route[data-deployment='{deployment}']")
    return row.find_element(_by("css"), ".weight").text, row.find_element(_by("css"), ".effective").text


def test_route_weight_changed_through_the_reload_path(browser, console_gateway):
    _sign_in(browser, console_gateway.ui)
    browser.get(f"{console_gateway.ui}/models")
    assert _route_cells(browser, "digits", "digits-a") == ("70", "70")
    console_gateway.write_config(weight_a=40)
    try:
        button = browser.find_element(_by("id"), "reload")
        button.click()
        _navigated(browser, button)
        _wait(browser, lambda d: _route_cells(d, "digits", "digits-a") == ("40", "40"))
        assert _route_cells(browser, "digits", "digits-b") == ("60", "60")
        screenshot(browser, "models-reloaded")
    finally:
        console_gateway.write_config(weight_a=70)
        httpx.post(f"{console_gateway.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def _read_table(driver: Any, table: str) -> dict[str, list[str]]:
    """A traffic table's rows by their first cell (may raise stale mid-swap: `_wait` reads again)."""
    rows = driver.find_elements(_by("css"), f"#{table} tbody tr")
    cells = [[td.text for td in r.find_elements(_by("css"), "td")] for r in rows]
    return {row[0]: row for row in cells if row}


def _table(driver: Any, table: str) -> dict[str, list[str]]:
    return _wait(driver, lambda d: _read_table(d, table))


def test_live_traffic_moves_while_a_load_runs(browser, console_gateway):
    key = create_key(console_gateway.url, "acme")
    _sign_in(browser, console_gateway.ui)
    browser.get(f"{console_gateway.ui}/traffic")
    before = int(_table(browser, "traffic-models")["digits"][6].replace(",", ""))
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(
                    f"{console_gateway.url}/v1/models/digits:predict",
                    json={"instances": [[0.0] * 64]},
                    headers={"Authorization": f"Bearer {key}"},
                )

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # the page's own refresh (no reload) shows requests per second and a growing total
        row = _wait(
            browser,
            lambda d: (
                (r := _read_table(d, "traffic-models").get("digits"))
                and r[1] not in ("–", "0")
                and int(r[6].replace(",", "")) > before + 20
                and r
            ),
        )
        screenshot(browser, "traffic-under-load")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert float(row[1].replace(",", "")) > 0 and row[2] != "–"  # requests/s and p50 latency
    assert float(_table(browser, "traffic-tenants")["acme"][1].replace(",", "")) > 0

    # the same load is this month's usage on the tenants page, drawn as a bar per model
    link = browser.find_element(_by("id"), "nav-tenants")
    link.click()
    _navigated(browser, link)
    acme = _wait(browser, lambda d: d.find_element(_by("id"), "tenant-acme"))
    bars = acme.find_elements(_by("css"), "svg.chart rect.bar")
    labels = [t.text for t in acme.find_elements(_by("css"), "svg.chart text.chart-label")]
    assert bars and "digits" in labels
    screenshot(browser, "tenants-usage")


def test_a_tenant_key_is_no_console_session(browser, console_gateway):
    tenant_key = create_key(console_gateway.url, "acme")
    browser.get(f"{console_gateway.ui}/")
    browser.delete_all_cookies()
    browser.add_cookie({"name": "fleetgate_console", "value": tenant_key, "path": "/admin/ui"})
    for page in ("tenants", "keys", "models", "traffic"):
        browser.get(f"{console_gateway.ui}/{page}")
        assert browser.find_elements(_by("id"), "admin_key"), page
        assert not browser.find_elements(_by("css"), "nav")
    browser.find_element(_by("id"), "admin_key").send_keys(tenant_key)
    button = browser.find_element(_by("id"), "sign-in")
    button.click()
    _navigated(browser, button)
    assert "not the admin key" in _wait(browser, lambda d: d.find_element(_by("id"), "login-error")).text
    screenshot(browser, "login-refused")
