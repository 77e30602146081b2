"""Open the dashboard in headless Chromium: it loads from disk with all its plots drawn, no
console errors and no network request. Talks to the browser over the DevTools protocol (events
carry the console level and exceptions, unlike parsing stderr logs). The screenshot is kept in
artifacts/dashboard-browser/.

Skipped when Chromium is absent, unless ATTNBENCH_REQUIRE_BROWSER is set (CI sets it after
scripts/ci.d/pre-chromium.sh installs Debian's chromium).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard-browser"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--window-size=1400,1000", "--remote-debugging-port=0", "--remote-allow-origins=*"]
# Every plot drawn: plotly sets _fullLayout on its div and draws one g.trace per trace.
COUNT_PLOTS = ("[...document.querySelectorAll('.js-plotly-plot')]"
               ".filter(d => d._fullLayout && d.querySelector('g.trace')).length")


def _chromium() -> str | None:
    env = os.environ.get("ATTNBENCH_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


class Browser:
    """One headless Chromium with a fresh profile, driven through its page's DevTools socket."""

    def __init__(self, exe: str, profile: Path) -> None:
        from websockets.sync.client import connect

        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"  # written once the debugger listens
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start its DevTools server ({exe})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            pages = [t for t in json.load(resp) if t["type"] == "page"]
        self._stack = contextlib.ExitStack()  # websockets wants its client as a context manager
        self.ws = self._stack.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        self.next_id = 0
        self.events: list[dict] = []
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.call(f"{domain}.enable")

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=deadline - time.monotonic())))

    def evaluate(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get(
            "value")

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d['text']}")
            elif e.get("method") == "Runtime.consoleAPICalled" and p["type"] in ("error",
                                                                                 "assert"):
                out.append("console." + p["type"] + ": " + " ".join(
                    str(a.get("value", a.get("description"))) for a in p["args"]))
            elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']}")
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        if getattr(self, "_stack", None) is not None:
            self._stack.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = _chromium()
    if exe is None:
        if os.environ.get("ATTNBENCH_REQUIRE_BROWSER"):
            pytest.fail("ATTNBENCH_REQUIRE_BROWSER is set but no chromium was found "
                        "(ATTNBENCH_CHROMIUM or chromium on PATH)")
        pytest.skip("chromium not installed (apt-get install chromium, or set "
                    "ATTNBENCH_CHROMIUM); set ATTNBENCH_REQUIRE_BROWSER=1 to make this fail")
    pytest.importorskip("websockets", reason="the DevTools client needs the websockets package")
    b = Browser(exe, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def _wait_plots(browser: Browser, want: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    drawn = browser.evaluate(COUNT_PLOTS)
    while drawn != want and time.monotonic() < deadline:
        time.sleep(0.2)
        drawn = browser.evaluate(COUNT_PLOTS)
    return drawn


# What a reader sees first: the headline table above the first plot, with the GPU suites'
# rows before the local CPU run's, each run labelled by origin.
LAYOUT = """(() => {
  const head = document.querySelector('table.headline');
  const plot = document.querySelector('.js-plotly-plot');
  const gpu = document.getElementById('gpu-h100'), cpu = document.getElementById('gpu-cpu');
  const rows = [...head.querySelectorAll('tr')].slice(1).map(r => r.cells[0].innerText);
  return {headFirst: !!(head.compareDocumentPosition(plot) & 4),
          gpuFirst: !!(gpu.compareDocumentPosition(cpu) & 4), rows,
          origins: [...head.querySelectorAll('.origin')].map(o => o.innerText)};
})()"""


def test_dashboard_loads_with_plots_and_no_console_errors(browser, tmp_path):
    from test_report import add_local_cpu_run, make_results

    from attnbench.report.build import build_report

    results = make_results(tmp_path / "results", np.random.default_rng(31))
    add_local_cpu_run(results, np.random.default_rng(32))
    out = build_report(results, tmp_path / "dash")
    assert out.figures >= 5
    browser.open(out.html.as_uri())
    drawn = _wait_plots(browser, out.figures)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = browser.call("Page.captureScreenshot", format="png")
    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
    assert drawn == out.figures, f"{drawn} of {out.figures} plots drawn"
    assert browser.evaluate("document.title") == "attnbench dashboard"
    layout = browser.evaluate(LAYOUT)
    assert layout["headFirst"] and layout["gpuFirst"], layout
    assert layout["rows"] == ["H100", "H100", "CPU"]
    assert layout["origins"] == ["committed", "committed", "local"]
    assert browser.errors() == []
    outside = [u for u in browser.requests() if not u.startswith(("file:", "data:", "blob:"))]
    assert outside == [], f"the dashboard fetched {outside}"


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    """The same checks on a page with a script error and a missing plot must fail."""
    page = tmp_path / "broken.html"
    page.write_text("<html><body><div class='js-plotly-plot'></div><script>"
                    "console.error('deliberate'); notDefined();</script></body></html>")
    browser.open(page.as_uri())
    errors = browser.errors()
    assert any("deliberate" in e for e in errors)
    assert any("notDefined" in e for e in errors)
    assert _wait_plots(browser, 1, timeout=1) == 0
