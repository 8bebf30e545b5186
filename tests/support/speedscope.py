"""Open a Chrome trace in speedscope (the npm package's static page) in headless Chromium,
offline, and read back the names it gives the tracks.

The page and the trace are served from 127.0.0.1 (Chromium does not let a ``file://``
page fetch another file). A small page of ours holds speedscope in a frame, presses
``n`` (next profile) until every profile was shown, and writes the names it saw into
its own DOM, which ``--dump-dom`` prints.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.tools import INSTALL, missing

CHROMIUM = "chromium-headless-shell"
PAGE = """<!doctype html><html><body>
<iframe id="f" src="speedscope/index.html#profileURL=/trace.json" width="1400" height="900">
</iframe><pre id="out"></pre>
<script>
const seen = [];
function step() {
  const doc = document.getElementById("f").contentDocument;
  const text = doc && doc.body ? doc.body.innerText : "";
  const line = text.split("\\n").find((l) => /\\(pid \\d+\\)/.test(l));
  if (line && !seen.includes(line)) seen.push(line);
  document.getElementById("out").textContent = JSON.stringify(seen);
  if (line) {
    for (const type of ["keydown", "keypress"]) {
      doc.dispatchEvent(new KeyboardEvent(type, {key: "n", bubbles: true}));
    }
  }
  setTimeout(step, 200);
}
setTimeout(step, 500);
</script></body></html>
"""


def static_folder() -> Path | None:
    """speedscope's built page (``$SPEEDSCOPE_DIR``, else the global npm package's)."""
    candidates = []
    if os.environ.get("SPEEDSCOPE_DIR"):
        candidates.append(Path(os.environ["SPEEDSCOPE_DIR"]))
    if shutil.which("npm"):
        root = subprocess.run(
            ["npm", "root", "-g"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
        candidates.append(Path(root) / "speedscope" / "dist" / "release")
    return next((c for c in candidates if (c / "index.html").is_file()), None)


def unavailable() -> str | None:
    """Why speedscope cannot be opened here (a tool missing, named), or None."""
    if shutil.which(CHROMIUM) is None:
        return missing(CHROMIUM)
    if static_folder() is None:
        return f"needs speedscope ({INSTALL['speedscope']}, or set SPEEDSCOPE_DIR)"
    return None


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No log lines in the test output."""


SANDWICH_PAGE = """<!doctype html><html><body>
<iframe id="f" src="speedscope/index.html#profileURL=/trace.json" width="1400" height="900">
</iframe><pre id="out"></pre>
<script>
function step() {
  const doc = document.getElementById("f").contentDocument;
  const text = doc && doc.body ? doc.body.innerText : "";
  if (/\\(pid \\d+\\)/.test(text)) {
    for (const type of ["keydown", "keypress"]) {
      doc.dispatchEvent(new KeyboardEvent(type, {key: "3", bubbles: true}));
    }
    document.getElementById("out").textContent = JSON.stringify(text.split("\\n"));
  }
  setTimeout(step, 300);
}
setTimeout(step, 500);
</script></body></html>
"""


def _shown(trace: Path, work: Path, page: str) -> list[str]:
    """What ``page`` (holding speedscope on ``trace`` in a frame) wrote into its
    ``<pre id="out">`` as a JSON list, read from headless Chromium's DOM."""
    site = work / "site"
    if not (site / "speedscope").is_dir():
        shutil.copytree(static_folder(), site / "speedscope")  # type: ignore[arg-type]
    shutil.copy(trace, site / "trace.json")
    (site / "page.html").write_text(page)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom = subprocess.run(
            [
                CHROMIUM,
                "--no-sandbox",
                "--window-size=1400,1000",
                "--virtual-time-budget=15000",
                "--dump-dom",
                f"http://127.0.0.1:{server.server_address[1]}/page.html",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        ).stdout
    finally:
        server.shutdown()
        server.server_close()
    found = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return list(json.loads(html.unescape(found[1])))


def track_names(trace: Path, work: Path) -> list[str]:
    """The names speedscope shows for the profiles (tracks) of ``trace``, in order."""
    return _shown(trace, work, PAGE)


def sandwich_lines(trace: Path, work: Path) -> list[str]:
    """The text lines of speedscope's Sandwich view (its table of frames, one row per
    distinct frame: the groups Left Heavy and Sandwich draw) for the first profile."""
    return _shown(trace, work, SANDWICH_PAGE)
