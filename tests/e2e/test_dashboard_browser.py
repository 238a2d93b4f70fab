"""End to end in a real browser: the seeded API, `streamlit run dashboard/app.py`, and headless
Chromium (Debian's chromium + chromium-driver; .ci/run installs them) opening every page,
checking its content and saving a screenshot (under the test's temporary folder, or
CANARY_SCREENSHOTS when set)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT
from tests.loopback import free_port, wait_http

PAGES = {
    "Overview": ["Inference quality overview", "The canary is stale: schedule 'daily'", "int2", "domain PPL",
                 "breaching since", "ppl ratio"],
    "Compare": ["Compare configs", "Quality lost vs speed and memory gained",
                "its results reused from run 1"],  # the newest run: the seeded gate, whose baseline is run 1's
    "Trends": ["Trends", "Suite s only", "alert: int2"],
    "Alerts": ["Alerts", "The canary is stale", "CanaryStale", "Firing (", "Silences", "needs a write key"],
    "Run+detail&run_id=1": ["Run detail", "Breaching (", "Rank samples by",  # the seeded run of every config
                            "Perplexity by position in the context and in the answer",
                            "Next-token distributions against the baseline", "Task accuracy on labelled items"],
    "Gates": ["CI gates"],
}


def chrome():
    exe, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not exe or not driver:
        msg = "chromium / chromedriver are not installed (Debian: apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"CI=true: {msg}", pytrace=False)
        pytest.skip(f"SKIPPED LOUDLY: {msg}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = exe
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1300"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture(scope="module")
def dashboard(seeded_api, tmp_path_factory):
    port = free_port()
    log = str(tmp_path_factory.mktemp("st") / "streamlit.log")
    env = {**os.environ, "CANARY_API_URL": seeded_api["url"]}
    env.pop("CANARY_DASHBOARD_WRITE_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "dashboard/app.py"),
                             "--server.port", str(port),
                             "--server.headless", "true", "--browser.gatherUsageStats", "false"],
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


def test_every_page_in_headless_chromium(dashboard, seeded_api, tmp_path):
    shots = pathlib.Path(os.environ.get("CANARY_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    browser = chrome()
    # the smoke run, the last of the seed's `canary run`s: 4 documents were too few, so it topped up
    runs = httpx.get(f"{seeded_api['url']}/api/v1/projects/dash/runs", params={"limit": 200}, timeout=30).json()
    smoke = max(r["run_id"] for r in runs if r["trigger"] == "manual")
    pages = {**PAGES, f"Run+detail&run_id={smoke}": ["Run detail", "12 samples (topped up from 4)"]}
    try:
        for page, needles in pages.items():
            browser.get(f"{dashboard}/?page={page}&project=dash")
            deadline = time.time() + 60
            text = ""
            while time.time() < deadline:
                text = browser.find_element("tag name", "body").text
                if all(n in text for n in needles) and "Running..." not in text:
                    break
                time.sleep(0.5)
            time.sleep(1)  # let charts finish drawing before the screenshot
            path = shots / f"{page.replace('+', '-').replace('&run_id=', '-').lower()}.png"
            browser.save_screenshot(str(path))
            missing = [n for n in needles if n not in text]
            assert not missing, f"{page}: missing {missing}; page text: {text[:1500]}"
            assert "Traceback" not in text and "Error" not in text.split("\n")[0]
            assert path.stat().st_size > 10_000
            if page == "Run+detail&run_id=1":  # the distributions table, opened as a reader opens it
                browser.find_element("xpath", "//summary[contains(., 'Next-token distributions')]").click()
                deadline = time.time() + 30
                while "KLD by position" not in text and time.time() < deadline:
                    time.sleep(0.5)
                    text = browser.find_element("tag name", "body").text
                browser.save_screenshot(str(shots / "run-detail-1-distributions.png"))
                assert "KLD by position" in text and "0–127 " in text and "128–255 " in text, text[:3000]
                # the position table, open (a flagged config opens it) or opened: the generated answers'
                # rows, by token index in the answer
                positions = browser.find_element("xpath", "//details[summary[contains(., 'Perplexity by position')]]")
                if positions.get_attribute("open") is None:
                    positions.find_element("tag name", "summary").click()
                deadline = time.time() + 30
                rows: list[str] = []
                while not rows and time.time() < deadline:
                    time.sleep(0.5)
                    rows = [" ".join(r.text.split()) for r in positions.find_elements("css selector", "tbody tr")
                            if "answer" in r.text]
                browser.execute_script("arguments[0].scrollIntoView()", positions)
                browser.save_screenshot(str(shots / "run-detail-1-positions.png"))
                assert any(r.startswith("int2 answer 0–15 ") for r in rows), rows or positions.text[:3000]
                assert any(r.startswith("int2 answer 16–63 ") for r in rows), rows
            if page == "Overview":  # the answer at the top: the critical config first, with its CI
                first = browser.find_elements("css selector", "table tbody tr")[0].text
                assert first.startswith("int2") and "critical" in first and "% [" in first, first
                # the card, as drawn: the perplexity tile red with its state in words, above the table
                tile = browser.find_element("css selector", '.canary-tile[data-state="critical"]')
                assert tile.text.startswith("domain PPL") and "int2, worst of 3 on ppl ratio" in tile.text
                assert tile.text.endswith("CRITICAL"), tile.text  # the word, not only the colour
                assert tile.value_of_css_property("background-color") == "rgba(255, 205, 210, 1)"  # #ffcdd2
                table = browser.find_element("css selector", "table")
                assert tile.location["y"] < table.location["y"]
                # the field signals' tiles (docs/scorers.md), drawn with a state in words
                drawn = {t.text.split("\n")[0]: t for t in browser.find_elements("css selector", ".canary-tile")}
                for title in ("lossless outputs", "generation health"):
                    assert title in drawn, list(drawn)
                    state = drawn[title].get_attribute("data-state")
                    assert state in ("ok", "inconclusive", "warn", "critical", "measurement_error"), state
                    assert drawn[title].text.endswith(state.replace("_", " ").upper()), drawn[title].text
    finally:
        browser.quit()


def test_the_run_report_opens_offline_in_chromium(seeded_api, tmp_path):
    """`GET …/runs/1/report` (what `canary report` and `canary gate --report-html` write) on the seeded
    run of every config: one file that Chromium opens with no request for anything else, showing the
    verdict for people, the quality-vs-speed SVG, every comparison and the field signals."""
    run = httpx.get(f"{seeded_api['url']}/api/v1/projects/dash/runs/1", timeout=30).json()
    r = httpx.get(f"{seeded_api['url']}/api/v1/projects/dash/runs/1/report", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text[:500]
    html = r.text
    assert "<script" not in html and "src=" not in html and "href=" not in html and "@import" not in html
    path = tmp_path / "report.html"
    path.write_text(html, encoding="utf-8")
    browser = chrome()
    try:
        browser.get(path.as_uri())
        text = browser.find_element("tag name", "body").text
        assert f"verdict: {run['verdict']}" in text
        for line in run["summary"]["lines"]:  # the verdict for people, as the API gives it
            assert line.strip() in text, (line, text[:3000])
        assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
        svg = browser.find_element("css selector", "svg")
        assert svg.size["height"] >= 300 and "int2" in svg.text and "int8" in svg.text
        rows = browser.find_elements("css selector", "table tr")
        assert len(rows) > len(run["comparisons"])  # every comparison, then the signals and worst documents
        assert "Field signals" in text and "confident div." in text  # spec-ngram is lossless: its noise floor
        assert "Worst documents per candidate" in text and "int2" in text
        assert "Next-token distributions against the baseline" in text and "bracketed" in text  # kld_mean, measured
        assert "Task accuracy on labelled items" in text and "right→wrong" in text  # the 24 labelled items
        shots = pathlib.Path(os.environ.get("CANARY_SCREENSHOTS", tmp_path))
        shots.mkdir(parents=True, exist_ok=True)
        browser.set_window_size(1400, 3000)
        browser.save_screenshot(str(shots / "report.png"))
    finally:
        browser.quit()
