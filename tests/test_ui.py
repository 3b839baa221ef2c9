"""The operator page (/ui) in a real headless browser (Debian's chromium, driven by selenium) against a real
`patchserve serve` process on a real redis-server: tasks, versions, rollback, request rates, try-it, jobs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from patchserve.patches.jobs import JobQueue
from tests.helpers import make_patch, served, synthetic_rows

ADMIN = "ui-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(redis_url, tiny_bert_dir, tiny_encoder, tmp_path_factory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("ui")
    registry = f"{redis_url}?prefix=ui-{uuid.uuid4().hex[:6]}:"
    env = {"PATCHSERVE_REGISTRY": registry, "PATCHSERVE_MODEL": str(tiny_bert_dir), "PATCHSERVE_DEVICE": "cpu"}
    served_args = ("--admin-token", ADMIN, "--slots", "4", "--workers", "2", "--metrics-task-labels", "1")
    with served(tmp, env, *served_args) as base:
        for seed in (1, 2):
            patch = make_patch(tiny_encoder, "sentiment", seed=seed)
            assert httpx.post(f"{base}/tasks", files={"patch": ("p", patch.data)}, headers=AUTH).status_code == 201
        tagger = make_patch(tiny_encoder, "pos", kind="token-classification", seed=3, lora_rank=2)
        assert httpx.post(f"{base}/tasks", files={"patch": ("p", tagger.data)}, headers=AUTH).status_code == 201
        yield base, registry


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail(
            "the browser test needs Debian's chromium and chromedriver: apt-get install chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--no-first-run",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def _wait(chrome, condition, timeout: float = 20):
    # the page refreshes its tables every few seconds: an element read mid-refresh is stale, so read it again
    return WebDriverWait(chrome, timeout, ignored_exceptions=[StaleElementReferenceException]).until(condition)


def _text(chrome, selector: str) -> str:
    return chrome.find_element(By.CSS_SELECTOR, selector).text


def _click(chrome, selector: str) -> None:
    """Click, again if a refresh replaced the element between finding and clicking it."""
    _wait(chrome, lambda c: c.find_element(By.CSS_SELECTOR, selector).click() or True)


def test_the_operator_page(server, browser, tmp_path):
    base, registry = server
    chrome = browser
    queue = JobQueue(registry)
    rows = "".join(__import__("json").dumps(r) + "\n" for r in synthetic_rows("classification", 40, 1))
    job = queue.submit({"task": "sentiment", "max_steps": 10}, {"train": ("train.jsonl", rows.encode())})

    chrome.get(f"{base}/ui")
    assert "patchserve" in chrome.title
    _wait(chrome, lambda c: "HTTP 401" in _text(c, "#message"))  # reads need the token, and the page says so
    token = chrome.find_element(By.ID, "token")
    token.send_keys(ADMIN)
    chrome.execute_script("arguments[0].dispatchEvent(new Event('change'))", token)

    # tasks with their current version
    _wait(chrome, ec.presence_of_element_located((By.CSS_SELECTOR, "tr[data-task='sentiment'] td.version")))
    _wait(chrome, lambda c: _text(c, "tr[data-task='sentiment'] td.version") == "v2")
    _wait(chrome, lambda c: "token-classification" in _text(c, "tr[data-task='pos']"))
    assert _text(chrome, "tr[data-task='pos'] td.type") == "lora"  # the patch type: BitFit and LoRA side by side
    assert _text(chrome, "tr[data-task='sentiment'] td.type") == "bitfit"

    # versions with their metrics, and rollback
    _click(chrome, "button[data-action='versions'][data-task='sentiment']")
    _wait(chrome, ec.presence_of_element_located((By.CSS_SELECTOR, "table.versions-of tr[data-version='1']")))
    _wait(chrome, lambda c: "dev_accuracy 0.500" in _text(c, "table.versions-of tr[data-version='1']"))
    _click(chrome, "button[data-action='rollback'][data-version='1']")
    _wait(chrome, lambda c: "version 1 is current" in _text(c, "#message"))
    _wait(chrome, lambda c: _text(c, "tr[data-task='sentiment'] td.version") == "v1")
    assert httpx.get(f"{base}/tasks/sentiment", headers=AUTH).json()["current"] == 1

    # the try-it box predicts
    chrome.find_element(By.ID, "try-task").send_keys("sentiment")
    _click(chrome, "form#try button[type='submit']")
    _wait(chrome, lambda c: "(sentiment v1)" in _text(c, "#answer"))
    assert _text(c := chrome, "#answer").count("->") == 2 and "a tedious mess" in _text(c, "#answer")

    # per-task request rate from the server's own metrics: 'sentiment' is served first (20 requests on new
    # connections reach both front ends), so it has series of its own (--metrics-task-labels 1); 'pos' counts among
    # the other tasks
    for task in ("sentiment", "pos"):
        for _ in range(20):
            httpx.post(f"{base}/tasks/{task}/predict", json={"inputs": "the cat runs"}, headers=AUTH)
    _wait(chrome, lambda c: _text(c, "tr[data-task='sentiment'] td.rate") not in ("\u2013", "0.0"), timeout=30)
    _wait(chrome, lambda c: "requests/s together" in _text(c, "#tasks"), timeout=30)
    _wait(chrome, lambda c: _text(c, "tr[data-task='pos'] td.rate") == "\u2013")  # an en dash: no figures

    # jobs: the queued one is listed and can be cancelled from the page
    selector = f"tr[data-job='{job.id}']"
    _wait(chrome, ec.presence_of_element_located((By.CSS_SELECTOR, selector)))
    _wait(chrome, lambda c: "queued" in _text(c, f"{selector} td.status"))
    _click(chrome, f"{selector} button[data-action='cancel']")
    _wait(chrome, lambda c: "cancelled" in _text(c, f"{selector} td.status"))
    assert queue.get(job.id).status == "cancelled"

    # delete, with the page's confirmation
    _click(chrome, "button[data-action='versions'][data-task='pos']")
    _wait(chrome, ec.element_to_be_clickable((By.CSS_SELECTOR, "button[data-action='delete'][data-task='pos']")))
    _click(chrome, "button[data-action='delete'][data-task='pos']")
    chrome.switch_to.alert.accept()
    _wait(chrome, lambda c: not c.find_elements(By.CSS_SELECTOR, "tr[data-task='pos']"))
    assert [t["name"] for t in httpx.get(f"{base}/tasks", headers=AUTH).json()] == ["sentiment"]

    # every asset came from the server itself
    sources = chrome.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert sources and all(s.startswith(base) for s in sources), sources
    shot = Path(os.environ.get("PATCHSERVE_UI_SCREENSHOT", tmp_path / "ui.png"))
    # (sentiment's versions are still open: they stay open across refreshes)
    _wait(chrome, ec.visibility_of_element_located((By.CSS_SELECTOR, "table.versions-of tr[data-version='2']")))
    assert chrome.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    queue.close()
