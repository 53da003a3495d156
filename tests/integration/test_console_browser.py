"""The console in a real headless browser (Debian's chromium and chromedriver, driven by
Selenium): it loads the review queue, opens a proposal by its link and sees its verified chain
and its timeline; a proposal whose fields carry a script shows it as text and runs nothing.

Without chromium this test is skipped, naming the packages to install, so the README's test
command works on a fresh machine; CI installs chromium and sets IMPROVED_REQUIRE_BROWSER=1
(`.ci/run`), and there a missing browser fails the run instead."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from improved.client.sdk import MeshClient
from improved.protocol.model import Summary
from improved.runtime.store import Store
from tests.bus import eventually
from tests.console import running
from tests.factories import skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900")
SCRIPT = "<script>document.title='pwned'</script>"


def _browser_or_skip() -> None:
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return
    why = (f"no chromium at {CHROMIUM} or chromedriver at {CHROMEDRIVER}: apt-get install "
           "chromium chromium-driver")
    if os.environ.get("IMPROVED_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{why} (IMPROVED_REQUIRE_BROWSER=1: the browser test must run here)")
    pytest.skip(why)


def _browse(base: str, pid: str) -> dict:
    """Queue → click the proposal → its page; what the browser saw."""
    from selenium import webdriver
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    profile = tempfile.mkdtemp(prefix="improved-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(20)
        wait = WebDriverWait(driver, 15)
        driver.get(base)
        wait.until(ec.presence_of_element_located((By.ID, "queue")))
        seen = {"queue_title": driver.title}
        link = driver.find_element(By.CSS_SELECTOR, f'a.proposal[href="/p/{pid}"]')
        seen["link"] = link.text
        link.click()
        chain = wait.until(ec.presence_of_element_located((By.ID, "chain")))
        seen.update(url=driver.current_url, title=driver.title, chain=chain.text,
                    chain_class=chain.get_attribute("class"),
                    heading=driver.find_element(By.TAG_NAME, "h1").text,
                    rows=len(driver.find_elements(By.CSS_SELECTOR, "#timeline tr")) - 1,
                    forms=len(driver.find_elements(By.TAG_NAME, "form")),
                    scripts=len(driver.find_elements(By.TAG_NAME, "script")))
        try:
            driver.switch_to.alert  # noqa: B018 - raises when no script opened one
            seen["alert"] = True
        except NoAlertPresentException:
            seen["alert"] = False
        return seen
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


async def test_a_browser_loads_the_queue_opens_a_proposal_and_sees_its_verified_chain(
        daemon, nc, svc, nats_url, tmp_path):
    _browser_or_skip()
    client = MeshClient(nc, svc)
    pid = await client.publish(skill_proposal(
        svc, name="browse", summary=Summary(template_id="new_skill", args={"name": SCRIPT})))
    await eventually(lambda: client.decision(pid))
    trailers = len(await Store(nc).read_chain(svc, pid))
    with running(nats_url, tmp_path, daemon.config.checkpoint_key) as base:
        seen = await asyncio.wait_for(asyncio.to_thread(_browse, base, pid), 60)
    assert seen["link"] == pid[:12]
    assert seen["url"] == f"{base}p/{pid}"
    assert seen["chain"].startswith("VERIFIED: ") and seen["chain_class"] == "ok"
    assert seen["rows"] == trailers >= 2  # the timeline: every trailer of the chain
    assert SCRIPT in seen["heading"]  # shown as text ...
    assert seen["title"] != "pwned" and seen["scripts"] == 0 and not seen["alert"]  # ... inert
    assert seen["forms"] == 0  # read-only: started without an operator key
