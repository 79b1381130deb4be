"""The built documentation site (`make docs`) in a real browser: served on 127.0.0.1 by a thread of this test,
each main page opened in headless Chromium (Debian's `chromium`), which must render it with its navigation,
fetch every resource it asks for, and log nothing to the console. A screenshot of each page is saved under
tests/artifacts/docs/ (ignored by git) for a person to look at.

Skipped, saying why, where Chromium is not installed or the site is not built; `.ci/run` installs the one and
builds the other, so CI always runs it."""

from __future__ import annotations

import concurrent.futures
import functools
import html
import os
import re
import shutil
import signal
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import ROOT

SITE = Path(ROOT) / "docs" / "_build" / "html"
ARTIFACTS = Path(ROOT) / "tests" / "artifacts" / "docs"
# page -> its title, as the page's <h1> says it
PAGES = {
    "index": "lightning-asyncckpt",
    "getting-started": "Getting started",
    "trainer": "The Trainer",
    "tiers": "Two tiers: node-local checkpoints with replicas on peer nodes",
    "failures": "When a save fails",
    "api": "API reference",
    "changelog": "Changelog",
}
BROWSER_TIMEOUT_S = 90
# what a page's navigation must hold: the sidebar's links to the other pages
NAV_LINKS = ("getting-started.html", "trainer.html", "api.html", "architecture.html")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class _Requests(SimpleHTTPRequestHandler):
    """Serves the site; records every request's path and status (a 404 is a broken link or asset)."""

    seen: list[tuple[str, int]]

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def log_request(self, code: object = "-", size: object = "-") -> None:
        self.seen.append((self.path, int(code) if str(code).isdigit() else 0))


@pytest.fixture(scope="module")
def site():
    if not (SITE / "index.html").is_file():
        pytest.skip(f"the documentation site is not built ({SITE} has no index.html): run `make docs` first")
    if chromium() is None:
        pytest.skip("Chromium is not installed (`apt-get install chromium`, as .ci/run does)")
    handler = type("Handler", (_Requests,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def open_page(url: str, screenshot: Path, profile: Path) -> tuple[str, str]:
    """Chromium's DOM of ``url`` after it loaded (stdout) and its log (stderr, console messages included);
    the screenshot is written to ``screenshot``. Bounded by BROWSER_TIMEOUT_S; the browser's whole process
    group is killed afterwards."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}",
           "--window-size=1280,900", f"--screenshot={screenshot}", "--dump-dom", url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=profile)
    try:
        out, err = proc.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Chromium did not finish {url} within {BROWSER_TIMEOUT_S}s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"Chromium exited {proc.returncode} on {url}:\n{err[-3000:]}"
    return out, err


def test_main_pages_render_with_navigation_and_no_errors(site, tmp_path):
    base, seen = site
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)

    def one(page: str) -> tuple[str, str, str]:
        profile = tmp_path / f"profile-{page}"
        profile.mkdir()
        dom, log = open_page(f"{base}/{page}.html", ARTIFACTS / f"{page}.png", profile)
        return page, dom, log

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, PAGES))

    problems = []
    for page, dom, log in results:
        h1 = re.search(r"<h1[^>]*>(.*?)</h1>", dom, re.S)
        title = html.unescape(re.sub(r"<[^>]+>", "", h1.group(1))).replace("\u00b6", "").strip() if h1 else None
        if title != PAGES[page]:
            problems.append(f"{page}: its <h1> is {title!r}, not {PAGES[page]!r} (did it render?)")
        nav = re.search(r'<div class="sidebar-tree">(.*?)</div>', dom, re.S)
        others = [link for link in NAV_LINKS if link != f"{page}.html"]  # a page links itself as "#"
        missing = [link for link in others if not nav or f'href="{link}' not in nav.group(1)]
        if missing:
            problems.append(f"{page}: the navigation lacks links to {missing}")
        console = [line for line in log.splitlines() if ":CONSOLE" in line]
        if console:
            problems.append(f"{page}: console messages: {console}")
        shot = ARTIFACTS / f"{page}.png"
        if not shot.is_file() or shot.stat().st_size < 10_000:
            problems.append(f"{page}: no screenshot, or an empty one, at {shot}")
    failed = sorted({(path, code) for path, code in seen if code >= 400 and path != "/favicon.ico"})
    if failed:
        problems.append(f"requests that failed: {failed}")
    assert not problems, "\n".join(problems)
    assert {path.split("?")[0] for path, _ in seen} >= {f"/{p}.html" for p in PAGES}
