"""A real browser for page tests: headless Chromium from Debian's `chromium` package.

The test setup installs the package when it is missing and this process may (root, apt-get on
the path): no browser download from anywhere else. Pages are read with `--dump-dom` after a
virtual-time budget, which lets the page's script run its fetches and timers; a failing test
writes a screenshot beside its other files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser")
INSTALL_TIMEOUT_S = 900
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--window-size=1280,1000"]


def chromium() -> str:
    """The browser's path, installing Debian's package first when it is missing."""
    found = next((path for path in map(shutil.which, CANDIDATES) if path), None)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("the page tests need Debian's chromium package: run `apt-get install chromium` "
                           "(as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, capture_output=True,
                             text=True, timeout=INSTALL_TIMEOUT_S)
    if install.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=INSTALL_TIMEOUT_S)
        install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, capture_output=True,
                                 text=True, timeout=INSTALL_TIMEOUT_S)
    found = next((path for path in map(shutil.which, CANDIDATES) if path), None)
    if found is None:
        raise RuntimeError(f"apt-get install chromium failed:\n{install.stdout[-2000:]}\n"
                           f"{install.stderr[-2000:]}")
    return found


def dump_dom(browser: str, url: str, budget_ms: int = 4000) -> str:
    """The page's DOM once its script has run for `budget_ms` of virtual time."""
    done = subprocess.run([browser, *FLAGS, f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed on {url}: {done.stderr[-2000:]}")
    return done.stdout


def screenshot(browser: str, url: str, path: Path, budget_ms: int = 4000) -> Path:
    subprocess.run([browser, *FLAGS, f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url],
                   capture_output=True, timeout=120)
    return path


class Element:
    def __init__(self, tag: str, attributes: dict[str, str | None]) -> None:
        self.tag = tag
        self.attributes = attributes
        self.text = ""
        self.children: list[Element] = []

    def find_all(self, tag: str, **attributes: str) -> list[Element]:
        """Descendants with this tag whose attributes (data_job_id= for data-job-id) match."""
        wanted = {name.replace("_", "-"): value for name, value in attributes.items()}
        found = []
        for child in self.children:
            if child.tag == tag and all(child.attributes.get(k) == v for k, v in wanted.items()):
                found.append(child)
            found.extend(child.find_all(tag, **attributes))
        return found

    def by_id(self, element_id: str) -> Element | None:
        for child in self.children:
            if child.attributes.get("id") == element_id:
                return child
            inner = child.by_id(element_id)
            if inner is not None:
                return inner
        return None


VOID = {"meta", "link", "input", "br", "img", "hr", "source", "col", "wbr", "area", "base", "embed"}


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, dict(attrs))
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        for element in self.stack[1:]:
            element.text += data


def parse(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    return builder.root
