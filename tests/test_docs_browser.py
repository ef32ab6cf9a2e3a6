"""The documentation site as a reader sees it: headless Chromium, 1280 px wide, opens the
results, the leaderboard and each tutorial, served from a fresh build on a loopback port.
On each page no table and no image reaches past the text column (a wide table scrolls
inside it), the page itself does not scroll sideways, every image loads, and no
code-formatted name in a table cell is broken across lines (`score_tune` / `d`).

Material wraps tables with its JavaScript once the page loads, so the layout is measured
in the browser, not in the HTML: the server adds a small script to each page, which
writes what it measured into the DOM; `chromium --dump-dom` prints it. Standard library
only, besides Chromium.

Skipped without Chromium (`apt-get install chromium` on Debian), except where
PREEMPT_REQUIRE_BROWSER=1 (CI) turns that into a failure, as PREEMPT_REQUIRE_PEER does for
the vLLM peer: the check must never pass by not running.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.test_docs import TUTORIALS, build_site

WIDTH = 1280  # a laptop's browser window, CSS px
PAGES = ["results/", "leaderboard/", *(f"tutorials/{t.stem}/" for t in TUTORIALS)]
TABLE_PAGES = {"results/", "leaderboard/"}  # pages that must have wide tables to check
SLACK_PX = 1.0  # sub-pixel rounding

# Runs after the load event (images laid out, material's tables wrapped). An element's
# visible box is its box cut by each ancestor that clips (overflow-x other than visible):
# a table inside a scrolling wrapper is as wide as the wrapper shows.
_MEASURE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const column = document.querySelector("article.md-content__inner").getBoundingClientRect();
  const visible = (el) => {
    const box = el.getBoundingClientRect();
    let left = box.left, right = box.right;
    for (let a = el.parentElement; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible") {
        const clip = a.getBoundingClientRect();
        left = Math.max(left, clip.left);
        right = Math.min(right, clip.right);
      }
    }
    return [left, right];
  };
  const name = (el) => el.tagName === "IMG" ? el.getAttribute("src")
    : (el.querySelector("th") || el).textContent.trim().slice(0, 60);
  const layout = {
    column: [column.left, column.right],
    viewport: document.documentElement.clientWidth,
    page_width: document.documentElement.scrollWidth,
    num_tables: 0,
    num_images: 0,
    elements: [],
    unloaded: [],
    broken_code: [],
  };
  for (const el of document.querySelectorAll(".md-content table, .md-content img")) {
    layout[el.tagName === "IMG" ? "num_images" : "num_tables"] += 1;
    layout.elements.push({name: el.tagName.toLowerCase() + " " + name(el), visible: visible(el)});
    if (el.tagName === "IMG" && !(el.complete && el.naturalWidth > 0)) layout.unloaded.push(name(el));
  }
  for (const code of document.querySelectorAll(".md-content td code, .md-content th code")) {
    if (code.getClientRects().length > 1) layout.broken_code.push(code.textContent);
  }
  const out = document.createElement("pre");
  out.id = "preempt-layout";
  out.textContent = JSON.stringify(layout);
  document.body.appendChild(out);
}, 50));
</script>"""
_LAYOUT = re.compile(r'<pre id="preempt-layout">(.*?)</pre>', re.S)


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        message = "no Chromium on PATH (Debian: apt-get install chromium)"
        if os.environ.get("PREEMPT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"PREEMPT_REQUIRE_BROWSER=1 but {message}")
        pytest.skip(message)
    return found


class _Handler(SimpleHTTPRequestHandler):
    """The built site as files, each HTML page with the measuring script before </body>."""

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix != ".html" or not path.is_file():
            return super().do_GET()
        body = path.read_text().replace("</body>", _MEASURE + "</body>", 1).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # quiet: the test reports what matters
        pass


def serve(site: Path) -> ThreadingHTTPServer:
    """`site` on a free loopback port, served from a daemon thread; shut it down after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def site_url(chromium, tmp_path_factory):
    site = tmp_path_factory.mktemp("browser") / "site"
    build_site(site)
    server = serve(site)
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def measure(chromium: str, url: str, width: int = WIDTH) -> dict[str, Any]:
    """What the page's script measured, in headless Chromium `width` CSS px wide."""
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no cache, no state
        result = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",  # root in a container
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--window-size={width},900",
                "--virtual-time-budget=10000",  # run the page's timers without waiting for them
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    found = _LAYOUT.search(result.stdout)
    assert found, f"{url}: the page's script wrote nothing (rc {result.returncode})\n{result.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def overflows(layout: dict[str, Any]) -> list[tuple[str, float]]:
    """Each table or image whose visible box reaches past the text column, and by how many px."""
    left, right = layout["column"]
    out = []
    for element in layout["elements"]:
        shown_left, shown_right = element["visible"]
        past = max(left - shown_left, shown_right - right)
        if past > SLACK_PX:
            out.append((element["name"], past))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_tables_and_images_fit_the_text_column(page, site_url, chromium):
    layout = measure(chromium, site_url + page)
    assert layout["viewport"] >= WIDTH - 20, layout["viewport"]  # the width asked for (less a scrollbar)
    if page in TABLE_PAGES:
        assert layout["num_tables"] > 0, f"{page}: no table measured"
    problems = []
    if past := overflows(layout):
        widest = max(px for _, px in past)
        names = sorted({name for name, _ in past})[:5]
        problems.append(f"{len(past)} tables or images reach past the column (by {widest:.0f} px): {names}")
    if layout["page_width"] > layout["viewport"]:
        problems.append(f"the page scrolls sideways: {layout['page_width']} px in {layout['viewport']}")
    if layout["unloaded"]:
        problems.append(f"images not loaded: {layout['unloaded'][:5]}")
    if layout["broken_code"]:
        names = sorted(set(layout["broken_code"]))[:8]
        problems.append(f"{len(layout['broken_code'])} code names in table cells split over lines: {names}")
    assert not problems, f"{page} at {WIDTH} px:\n" + "\n".join(problems)
