"""The course website (``make site``, ``book/build.py``) in a real headless Chromium, offline.

The fixture builds ``_site/`` as ``make site`` does (from the runs ``make test`` saved in
``_build/executed/``, notebooks run first for that; a lesson without a saved run is executed),
serves it on 127.0.0.1 and aborts every request to anywhere else, so a page that needs a CDN
fails here. Then, crawling from the home page along every internal link:

- every page loads with no console error, no page error, no failed or 4xx/5xx local request;
- every internal link resolves (the page or file exists; an ``#anchor`` exists on its page);
- every image is present and non-blank (decoded in the page: not all one colour);
- every lesson has its page, with the "run it" box and every figure its saved run drew, and no
  widget shown as bare text; any math is typeset by the bundled MathJax;
- the site's search finds a lesson.

Chromium and Playwright as ``tests/test_browser.py`` needs them (it skips without them, and
fails under ``CI=true``).
"""
from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from urllib.parse import urldefrag

import nbformat
import pytest
from test_browser import HOW, _MISSING, launched_chromium

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_site"
STAGED = ROOT / "_build" / "book"
PAGE_S = 60

pytestmark = pytest.mark.timeout(1800)  # a lesson without a saved run is executed while building

# In the page: every <img>, decoded; "blank" when all its pixels are one colour.
IMAGES_JS = """async () => Promise.all([...document.images].map(async (img) => {
  img.loading = "eager";
  try { await img.decode(); } catch (e) { return [img.src, "not decodable"]; }
  if (!img.naturalWidth) return [img.src, "empty"];
  const c = document.createElement("canvas");
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const ctx = c.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  for (let i = 4; i < d.length; i += 4)
    for (let k = 0; k < 4; k++) if (d[i + k] !== d[k]) return [img.src, "ok"];
  return [img.src, "blank"];
}))"""


@pytest.fixture(scope="module")
def site():
    """Build _site/ (make site), serve it on a free local port; yield the base URL.
    DTLIB_SITE_BUILT=1 tests the _site/ that is there (after a `make site`) without rebuilding."""
    if _MISSING:
        pytest.fail(f"site test needs {_MISSING}: {HOW}")
    if os.environ.get("DTLIB_SITE_BUILT") != "1":
        subprocess.run([sys.executable, str(ROOT / "book" / "build.py")], check=True, timeout=1700)
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # pytest shows failures, not every request
        pass


@pytest.fixture(scope="module")
def browser(site):
    with launched_chromium(PAGE_S) as chromium:
        context = chromium.new_context()
        # Offline: whatever is not this site is refused, and counted.
        outside: list[str] = []

        def route(r):
            if r.request.url.startswith(site) or r.request.url.startswith("data:"):
                r.continue_()
            else:
                outside.append(r.request.url)
                r.abort()

        context.route("**/*", route)
        context.outside = outside
        yield context


def _visit(context, url: str) -> tuple[list[str], list[str], list[tuple[str, str]], set[str], object]:
    """Open one page: (problems, links on it, images' verdicts, its element ids, the page)."""
    page = context.new_page()
    page.set_default_timeout(PAGE_S * 1000)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(url, wait_until="load")
    # MathJax typesets after load: wait for it, so an error it logs is seen
    page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise; }")
    links = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
    images = [tuple(x) for x in page.evaluate(IMAGES_JS)]
    ids = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
    return problems, links, images, ids, page


@pytest.fixture(scope="module")
def crawl(site, browser):
    """Every page reachable from the home page: url -> (problems, images, ids, text, figures in
    outputs, [math elements, typeset formulas]), the #anchors links point to, and the other files linked."""
    pages: dict[str, tuple] = {}
    anchors: list[tuple[str, str, str]] = []  # (from page, target page, fragment)
    files: set[str] = set()
    queue = deque([site + "index.html"])
    while queue:
        url = queue.popleft()
        if url in pages:
            continue
        problems, links, images, ids, page = _visit(browser, url)
        text = page.inner_text("body")
        figures = page.eval_on_selector_all(".cell_output img", "els => els.length")
        math = page.evaluate("[document.querySelectorAll('.math').length, document.querySelectorAll('mjx-container').length]")
        page.close()
        pages[url] = (problems, images, ids, text, figures, math)
        for link in links:
            target, fragment = urldefrag(link)
            if not target.startswith(site):
                continue
            if target.endswith("/"):
                target += "index.html"
            if fragment:
                anchors.append((url, target, fragment))
            (queue.append if target.endswith(".html") else files.add)(target)
    return pages, anchors, files


def test_every_page_loads_offline_without_errors(crawl, browser):
    pages, _, _ = crawl
    assert len(pages) > 40, sorted(pages)  # lessons, exercises, docs, API, home, run, search
    broken = {url: p[0] for url, p in pages.items() if p[0]}
    assert not broken, broken
    assert not browser.outside, f"requests outside the site (a page needs the network): {browser.outside[:10]}"


def test_every_internal_link_resolves(crawl, site):
    import urllib.request

    pages, anchors, files = crawl
    for file in sorted(files):  # not pages: images, downloads; served with 200
        with urllib.request.urlopen(file, timeout=10) as r:
            assert r.status == 200, file
    missing = [(src, f"{target}#{frag}") for src, target, frag in anchors
               if target in pages and frag not in pages[target][2]]
    assert not missing, missing[:20]


def test_every_image_is_present_and_not_blank(crawl):
    pages, _, _ = crawl
    bad = [(url, src, verdict) for url, p in pages.items() for src, verdict in p[1] if verdict != "ok"]
    assert not bad, bad[:20]
    assert sum(len(p[1]) for p in pages.values()) > 0


def test_every_lesson_has_its_page_its_figures_and_run_it(crawl, site):
    pages, _, _ = crawl
    lessons = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert lessons
    for lesson in lessons:
        url = f"{site}notebooks/{lesson.stem}.html"
        assert url in pages, f"no page for {lesson.name}"
        _, _, _, text, figures, _ = pages[url]
        assert "Run this lesson" in text and "dtlib course DIR" in text, lesson.name
        staged = nbformat.read(STAGED / "notebooks" / lesson.name, as_version=4)
        drawn = sum("image/png" in out.get("data", {}) for c in staged.cells for out in c.get("outputs", []))
        assert figures == drawn, f"{lesson.name}: {figures} figures on the page, {drawn} in its run"
        assert "VBox(children=" not in text, f"{lesson.name}: a widget shown as text, not as its figure"
    for exercise in sorted((ROOT / "exercises").glob("*.ipynb")):
        assert "Graded exercise" in pages[f"{site}exercises/{exercise.stem}.html"][3], exercise.name
    # Formulas (none in today's pages: the course writes them in Unicode) are typeset offline.
    untypeset = [url for url, p in pages.items() if p[5][0] and not p[5][1]]
    assert not untypeset, f"math not typeset by the bundled MathJax on {untypeset}"


def test_search_finds_a_lesson(site, browser):
    page = browser.new_page()
    page.set_default_timeout(PAGE_S * 1000)
    page.goto(site + "search.html?q=all-reduce")
    page.wait_for_selector("#search-results ul.search li a")
    hits = page.eval_on_selector_all("#search-results ul.search li a", "els => els.map(a => a.href)")
    page.close()
    assert any("/notebooks/" in h for h in hits), hits
