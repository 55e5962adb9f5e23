"""The /ui status page in a real headless browser (Debian's chromium, driven by Selenium): sign in
with an admin key, see a running batch with its progress bar and a usage chart; the screenshot is
kept under artifacts/ (SPOOL_ARTIFACTS_DIR) for CI."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import MODEL, ROOT, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None or shutil.which("chromedriver") is None,
    reason="needs Debian's chromium and chromium-driver (ops/bootstrap.sh installs them)",
)


def _gone(element):
    """Selenium's `staleness_of`, except that chromedriver may also report a node of the page just
    left as "does not belong to the document" (a WebDriverException, not a stale reference), which
    `staleness_of` lets through: a race with the navigation, seen once in CI."""
    from selenium.common.exceptions import WebDriverException

    def check(_driver) -> bool:
        try:
            element.is_enabled()
        except WebDriverException:  # StaleElementReferenceException included
            return True
        return False

    return check


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or ""
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1200,1400",
    ):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_status_page_shows_a_running_batch_and_usage(stack, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    client = stack.openai("beta")
    client.completions.create(model=MODEL, prompt="Warm up", max_tokens=8)  # some usage in the last hour
    lines = [
        {"custom_id": f"ui-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 60, "ignore_eos": True, "temperature": 0}}
        for i in range(40)
    ]  # fmt: skip
    f = client.files.create(file=("ui.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: (x := client.batches.retrieve(b.id)).status == "in_progress" and x.request_counts.completed, 120,
             "the batch under way")  # fmt: skip

    def sign_in(key: str, then: str) -> None:
        old = browser.find_element(By.TAG_NAME, "html")
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.ID, "sign-in").click()
        wait = WebDriverWait(browser, 30)
        wait.until(_gone(old))  # the form posted and a new page loaded
        wait.until(expected_conditions.presence_of_element_located((By.ID, then)))

    browser.get(stack.base_url + "/ui")
    sign_in("sk-spool-not-a-key", "login-error")  # a wrong key does not get in
    sign_in(stack.keys["beta"], "login-error")  # a user key does not either
    sign_in(stack.keys["admin"], "batches")
    assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]")  # it refreshes itself
    browser.get(stack.base_url + "/ui?refresh=0")  # hold still while the test reads it

    row = browser.find_element(By.XPATH, f"//tr[@class='batch'][td[1]='{b.id}']")
    assert row.get_attribute("data-status") == "in_progress"
    bar = row.find_element(By.CSS_SELECTOR, "[role=progressbar]")
    assert 0 < float(bar.get_attribute("aria-valuenow")) < 100
    models = browser.find_element(By.ID, "models").text
    assert MODEL in models
    chart = browser.find_element(By.ID, "usage-chart")
    assert chart.find_elements(By.TAG_NAME, "rect")  # bars were drawn
    assert "beta" in browser.find_element(By.ID, "usage-legend").text

    out = Path(os.environ.get("SPOOL_ARTIFACTS_DIR", ROOT / "artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "status-page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    client.batches.cancel(b.id)


def test_status_page_needs_an_admin_session(stack):
    with stack.http() as http:
        r = http.get("/ui")
        assert r.status_code == 200 and 'name="key"' in r.text and "Batches" not in r.text
        r = http.get("/ui", cookies={"spool_ui": "forged"})
        assert "Batches" not in r.text
