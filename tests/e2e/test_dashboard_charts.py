"""The charts on long and crowded histories (docs/service.md): the Trends page on 2 runs and on 30 runs of
15 configs, one of them collapsed (7× its baseline's perplexity), with alerts; read under
Streamlit's AppTest (the Vega-Lite spec as drawn) and in headless Chromium (the drawn chart's
size and that no label lies over another). The history is written straight into the database
(tests/e2e/history.py): these tests are about drawing, the figures come from a seeded generator."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT
from tests.e2e.history import seed_history
from tests.loopback import canary_serve, free_port, wait_http

APP = str(ROOT / "dashboard/app.py")


@pytest.fixture(scope="module", params=[2, 30], ids=["2-runs", "30-runs"])
def history_api(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"history{request.param}")
    url = f"sqlite:///{tmp / 'history.db'}"
    env = {**os.environ, "CANARY_DATABASE_URL": url, "CANARY_EXECUTION": "inline"}
    env.pop("CANARY_BROKER_URL", None)
    r = subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    seeded = seed_history(url, runs=request.param, configs=15)
    with canary_serve(env, str(tmp / "api.log"), "--no-upgrade-db") as base:
        yield {"url": base, "runs": request.param, "tmp": tmp, **seeded}


@pytest.fixture(scope="module")
def history_browser(history_api, tmp_path_factory):
    """`streamlit run dashboard/app.py` on the history's API and a headless Chromium at 1600×2400,
    shared by the browser tests of one history: (dashboard URL, browser, screenshot folder)."""
    from tests.e2e.test_dashboard_browser import chrome

    tmp = tmp_path_factory.mktemp("st")
    port = free_port()
    log = str(tmp / "streamlit.log")
    env = {**os.environ, "CANARY_API_URL": history_api["url"]}
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", APP, "--server.port", str(port),
                             "--server.headless", "true", "--browser.gatherUsageStats", "false"],
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    shots = pathlib.Path(os.environ.get("CANARY_SCREENSHOTS", tmp))
    shots.mkdir(parents=True, exist_ok=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, log)
        browser = chrome()
        try:
            browser.set_window_size(1600, 2400)
            yield f"http://127.0.0.1:{port}", browser, shots
        finally:
            browser.quit()
    finally:
        proc.terminate()
        proc.wait(20)


def datasets(at) -> dict:
    """The data frames behind the page's first Altair chart, by the name its layers use."""
    import pyarrow as pa

    chart = at.get("vega_lite_chart")[0].proto
    return {d.name: pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.datasets}


def trends(history_api, monkeypatch) -> AppTest:
    monkeypatch.setenv("CANARY_API_URL", history_api["url"])
    monkeypatch.delenv("CANARY_DASHBOARD_WRITE_KEY", raising=False)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["project"] = "history"
    at.run()
    assert not at.exception, at.exception
    at.sidebar.radio[0].set_value("Trends").run()
    assert not at.exception, at.exception
    return at


def test_trends_draw_a_collapsed_config_off_the_scale_and_list_alerts_under_the_chart(history_api, monkeypatch):
    at = trends(history_api, monkeypatch)
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    layers = spec["layer"]
    y = layers[0]["encoding"]["y"]
    # the collapsed config (6.96) lies beyond twice the critical threshold (2 × 1.3): off the scale, a
    # labelled marker along the top; the axis belongs to the thresholds and the configs near 1
    low, high = y["scale"]["domain"]
    assert low < 1.0 and 1.3 < high < 3.0, y
    data = datasets(at)
    off = [layer for layer in layers if layer["mark"].get("shape") == "triangle-up"]
    assert len(off) == 1
    drawn = data[off[0]["data"]["name"]]
    assert set(drawn["config"]) == {"kv-int2-collapsed"} and len(drawn) == history_api["runs"]
    assert (drawn["top"] == high).all()
    labels = {label for layer in layers if layer["mark"]["type"] == "text" and "data" in layer
              for label in data[layer["data"]["name"]].get("label", [])}
    assert "kv-int2-collapsed 6.96 ↑" in labels
    main = next(layer for layer in layers if layer["mark"]["type"] == "point" and "shape" in layer["encoding"])
    assert "kv-int2-collapsed" not in set(data[main["data"]["name"]]["config"])
    # every run drawn (no comparison cut off by the API's limit), every config a colour of its own
    points = next(layer for layer in layers if layer["mark"]["type"] == "point" and "shape" in layer["encoding"])
    colours = points["encoding"]["color"]["scale"]
    assert len(colours["domain"]) == 14 and len(set(colours["range"])) == 14  # 14 candidates, 14 colours
    x = points["encoding"]["x"]["axis"]
    assert x["labelOverlap"] == "greedy" and x["labelAngle"] == (0 if history_api["runs"] <= 8 else -40)
    # no text mark turned on its side (the alert labels that ran across the axis): alerts are markers
    # on the chart and a list under it
    assert not [layer for layer in layers if layer["mark"]["type"] == "text" and layer["mark"].get("angle")]
    listed = [m.value for m in at.markdown if "▼ run" in m.value]
    assert listed and "alert: kv-int2-collapsed critical" in listed[0]
    assert listed[0].count("▼ run") <= 8


def _chart(browser, url: str, page: str, ready: str = "") -> object:
    """Open a dashboard page and return its first chart's SVG once drawn (and `ready` is on the page)."""
    browser.get(f"{url}/?page={page}&project=history")
    deadline, charts = time.time() + 60, []
    while time.time() < deadline:
        charts = browser.find_elements("css selector", "[data-testid='stVegaLiteChart'] svg, "
                                                       "[data-testid='stVegaLiteChart'] canvas")
        if charts and ready in browser.find_element("tag name", "body").text:
            break
        time.sleep(0.5)
    time.sleep(2)  # let the chart finish drawing
    assert charts, browser.find_element("tag name", "body").text[:2000]
    assert charts[0].tag_name == "svg", charts[0].tag_name  # Streamlit draws Vega-Lite as SVG: its parts can be read
    return charts[0]


def _overlaps(boxes: list) -> list:
    """Pairs of [left, top, right, bottom, text] boxes that overlap by more than a pixel each way."""
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if min(a[2], b[2]) - max(a[0], b[0]) > 1 and min(a[3], b[3]) - max(a[1], b[1]) > 1]


BOXES = ("const r = t.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom, t.textContent]; });")


def test_trends_in_chromium_draw_a_full_height_plot(history_api, history_browser):
    """The page as a person sees it at 1600×2400: the plot area takes most of its 420 px (not a thin
    strip squeezed by labels), and no two axis labels overlap. Screenshot under CANARY_SCREENSHOTS."""
    url, browser, shots = history_browser
    chart = _chart(browser, url, "Trends", ready="▼ run")
    browser.save_screenshot(str(shots / f"trends-{history_api['runs']}-runs.png"))
    assert chart.size["height"] >= 400, chart.size  # the 420 px asked for, not a strip
    # the plot area fills most of the chart's height: the y axis' grid lines (horizontal) span it
    area = browser.execute_script(
        "const ys = [...arguments[0].querySelectorAll('.role-axis-grid line')].map(e => e.getBoundingClientRect())"
        ".filter(r => r.width > r.height).map(r => r.top);"
        "return ys.length > 1 ? Math.max(...ys) - Math.min(...ys) : null;", chart)
    assert area is not None and area >= 250, area
    # the axis labels of both axes: none over another (the labels Vega's greedy overlap removal hid
    # are still there, transparent: not drawn)
    labels = browser.execute_script(
        "return [...arguments[0].querySelectorAll('.role-axis-label text')]"
        ".filter(t => t.getAttribute('opacity') !== '0' && getComputedStyle(t).opacity !== '0').map(t => {" + BOXES,
        chart)
    assert not _overlaps([b for b in labels if b[4]])


def test_compare_plot_of_a_collapsed_config_in_chromium(history_api, history_browser):
    """The quality-vs-speed plot of the newest run of the history (14 candidates, one at +596 %): a
    symmetric log y axis whose ticks are named, both axes titled, and no config's label drawn over
    another's. Screenshot under CANARY_SCREENSHOTS."""
    url, browser, shots = history_browser
    chart = _chart(browser, url, "Compare")
    browser.save_screenshot(str(shots / f"compare-{history_api['runs']}-runs.png"))
    assert "symmetric log scale" in chart.text and "speed gain" in chart.text
    boxes = browser.execute_script("return [...arguments[0].querySelectorAll('.role-mark text')].map(t => {" + BOXES,
                                   chart)
    names = [b for b in boxes if b[4].startswith("cfg-") or "collapsed" in b[4] or "baseline" in b[4]]
    assert len(names) == 15, [b[4] for b in boxes]  # 14 candidates and the baseline, each labelled once
    assert not _overlaps(names)
