"""The console in a real headless browser (Debian's chromium and chromedriver, driven by
Selenium): it loads the review queue, opens a proposal by its link and sees its verified chain
and its timeline; a proposal whose fields carry a script shows it as text and runs nothing; it
filters the proposals with the front page's form (an applied L0, a waiting L2), reads the
mesh's state, and on the audit page sees the verdict since the last checkpoint, asks for the
whole log's verify and waits for its verdict as the page reloads itself. When a step fails, a
screenshot of the page is saved under the test's tmp dir and its path printed.

Without chromium this test is skipped, naming the packages to install, so the README's test
command works on a fresh machine; CI installs chromium and sets IMPROVED_REQUIRE_BROWSER=1
(`.ci/run`), and there a missing browser fails the run instead."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


@contextmanager
def _chromium(shot: Path) -> Iterator:
    """A headless Chromium driven by Selenium; when what runs in it fails, a screenshot of the
    page it was on is saved to `shot` (under the test's tmp dir) and its path printed."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="improved-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(20)
        yield driver
    except BaseException:
        with suppress(Exception):
            driver.save_screenshot(str(shot))
            print(f"screenshot of the page the browser was on: {shot}")
        raise
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _browse(base: str, pid: str, shot: Path) -> dict:
    """Queue → click the proposal → its page; what the browser saw."""
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    with _chromium(shot) as driver:
        wait = WebDriverWait(driver, 15)
        driver.get(f"{base}queue")
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


async def test_a_browser_loads_the_queue_opens_a_proposal_and_sees_its_verified_chain(
        daemon, nc, svc, nats_url, tmp_path):
    _browser_or_skip()
    client = MeshClient(nc, svc)
    pid = await client.publish(skill_proposal(
        svc, name="browse", summary=Summary(template_id="new_skill", args={"name": SCRIPT})))
    await eventually(lambda: client.decision(pid))
    trailers = len(await Store(nc).read_chain(svc, pid))
    with running(nats_url, tmp_path, daemon.config.checkpoint_key) as base:
        seen = await asyncio.wait_for(asyncio.to_thread(
                _browse, base, pid, tmp_path / "queue-failure.png"), 60)
    assert seen["link"] == pid[:12]
    assert seen["url"] == f"{base}p/{pid}"
    assert seen["chain"].startswith("VERIFIED: ") and seen["chain_class"] == "ok"
    assert seen["rows"] == trailers >= 2  # the timeline: every trailer of the chain
    assert SCRIPT in seen["heading"]  # shown as text ...
    assert seen["title"] != "pwned" and seen["scripts"] == 0 and not seen["alert"]  # ... inert
    assert seen["forms"] == 0  # read-only: started without an operator key


def _walk(base: str, svc: str, l0: str, l2: str, keyid: str, private: str, shot: Path) -> None:
    """Proposals → filtered by the form → the mesh → the audit log, its whole-log verify asked
    for by the button and its verdict waited for as the page reloads itself: each asserted as
    the browser shows it (a failure leaves a screenshot)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def listed(driver) -> list[tuple[str, str]]:
        return [(row.find_element(By.CSS_SELECTOR, "a.proposal").get_attribute("href")
                 .rsplit("/", 1)[1], row.find_element(By.CSS_SELECTOR, "td.status").text)
                for row in driver.find_elements(By.CSS_SELECTOR, "#proposals tr")[1:]]

    def text(driver, id_: str) -> str:
        return driver.find_element(By.ID, id_).text

    with _chromium(shot) as driver:
        wait = WebDriverWait(driver, 15)
        driver.get(base)
        wait.until(ec.presence_of_element_located((By.ID, "filters")))
        driver.find_element(By.ID, "filter-service").send_keys(svc)
        driver.find_element(By.ID, "filter").click()
        wait.until(lambda d: f"service={svc}" in d.current_url)
        assert listed(driver) == [(l2, "pending"), (l0, "applied")]  # newest first
        Select(driver.find_element(By.ID, "filter-status")).select_by_value("applied")
        driver.find_element(By.ID, "filter").click()
        wait.until(lambda d: "status=applied" in d.current_url)
        assert listed(driver) == [(l0, "applied")]

        driver.find_element(By.ID, "nav-mesh").click()
        wait.until(ec.presence_of_element_located((By.ID, "mesh")))
        assert text(driver, "crisis") == "none" and text(driver, "breaker") == "closed"
        assert text(driver, "autonomy") and keyid in text(driver, "daemons")
        assert "trailers up to stream sequence" in text(driver, "checkpoint")

        driver.find_element(By.ID, "nav-audit").click()
        assert wait.until(ec.presence_of_element_located((By.ID, "since"))).text == "VERIFIED"
        assert private not in driver.page_source
        driver.find_element(By.ID, "full-verify").click()
        full = WebDriverWait(driver, 90).until(
            ec.presence_of_element_located((By.ID, "full")))  # the page reloads itself
        assert full.text == "VERIFIED", driver.find_element(By.ID, "full-lines").text
        assert "chains verified" in text(driver, "full-lines")
        assert private not in driver.page_source


async def test_a_browser_walks_the_proposals_the_mesh_and_the_whole_log_verify(
        own_server, tmp_path):
    _browser_or_skip()
    from improved.client.keys import load_key
    from improved.core import signing
    from improved.protocol.model import ApplyResult
    from tests.bus import own_daemon
    from tests.factories import rank_proposal

    svc = "walked"
    async with own_daemon(own_server, tmp_path, "console-browser") as (nc, daemon):
        client = MeshClient(nc, svc)

        async def applier(order) -> ApplyResult:
            return ApplyResult(ok=True, applied_id="x", inverse={"delete": "x"},
                               rollbackable=True)

        sub = await client.serve_apply(applier)
        l0 = (await client.propose(rank_proposal(svc, key="walk"))).proposal_id
        assert (await eventually(lambda: client.outcome(l0), timeout=15)).ok
        await sub.unsubscribe()
        l2 = await client.publish(skill_proposal(svc, name="walk"))
        await eventually(lambda: client.decision(l2))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        key = daemon.config.checkpoint_key
        keyid = signing.keyid_of(signing.raw_public(load_key(key).public_key()))
        with running(own_server.url, tmp_path, key) as base:
            await asyncio.wait_for(asyncio.to_thread(
                _walk, base, svc, l0, l2, keyid, str(tmp_path),
                tmp_path / "walk-failure.png"), 150)
