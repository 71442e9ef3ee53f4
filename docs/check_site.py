"""Build the docs site and look at it in a real browser.

    python docs/check_site.py            # build (warnings as errors), check, screenshot
    python docs/check_site.py --no-build # check an existing docs/_build/html

Fails (exit 1) when:
* a local ``href``/``src`` in any built page points at a file that does not exist (a missing asset);
* a page with formulas, opened in headless Chromium, still shows raw TeX after MathJax ran: every
  ``class="math"`` element of the built HTML must have become an ``mjx-container``, and no ``\\(``, ``\\[`` or
  ``$$`` may be left in the rendered DOM.
Screenshots of the index, a guide with formulas and the API page go to ``docs/screenshots/*.png``. Without a
Chromium on the machine (``apt-get install chromium``) the browser part is skipped with a message; the asset
check still runs.
"""

from __future__ import annotations

import argparse
import html.parser
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.parse

DOCS = pathlib.Path(__file__).resolve().parent
BUILD = DOCS / "_build" / "html"
SHOTS = DOCS / "screenshots"
PAGES = {
    "index": "index.html",
    "getting_started": "getting_started.html",
    "noise_scale": "noise_scale.html",  # display maths
    "porting": "porting.html",  # a table-heavy guide
    "api": "api.html",
}
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",  # let MathJax typeset before the DOM is dumped or the picture taken
)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.math = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)
            if name == "class" and value and "math" in value.split():
                self.math += 1


def build() -> float:
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(BUILD)], check=True
    )
    return time.monotonic() - start


def missing_assets(root: pathlib.Path) -> list[str]:
    """Every local href/src of every built page that names a file that is not there."""
    missing = []
    for page in sorted(root.rglob("*.html")):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for link in parser.links:
            parsed = urllib.parse.urlsplit(link)
            if parsed.scheme or parsed.netloc or not parsed.path:  # external, or an anchor on this page
                continue
            target = (page.parent / urllib.parse.unquote(parsed.path)).resolve()
            if not target.exists():
                missing.append(f"{page.relative_to(root)} -> {link}")
    return missing


def math_elements(page: pathlib.Path) -> int:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.math


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def rendered_dom(browser: str, page: pathlib.Path) -> str:
    result = subprocess.run(
        [browser, *FLAGS, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout


def screenshot(browser: str, page: pathlib.Path, out: pathlib.Path) -> None:
    subprocess.run(
        [browser, *FLAGS, "--window-size=1280,1400", f"--screenshot={out}", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    if not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"no screenshot written for {page.name}")


def unrendered_math(dom: str, expected: int) -> list[str]:
    """What is wrong with a page's maths after MathJax ran (empty when all of it rendered)."""
    problems = []
    rendered = dom.count("<mjx-container")
    if rendered < expected:
        problems.append(f"{rendered} formulas rendered of {expected}")
    text = re.sub(r"<script.*?</script>|<style.*?</style>", "", dom, flags=re.S)
    for raw in (r"\(", r"\[", "$$"):
        if raw in text:
            i = text.index(raw)
            problems.append(f"raw {raw!r} left in the page: ...{text[max(0, i - 60) : i + 60]!r}...")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="check docs/_build/html as it is")
    args = parser.parse_args()
    if not args.no_build:
        print(f"built the site in {build():.1f} s (sphinx-build -W --keep-going -b html docs docs/_build/html)")
    failures = [f"missing asset: {m}" for m in missing_assets(BUILD)]
    print(f"local links and assets: {'all present' if not failures else f'{len(failures)} missing'}")

    browser = find_browser()
    if browser is None:
        print("SKIPPED the browser check: no Chromium found (apt-get update && apt-get install -y chromium)")
    else:
        SHOTS.mkdir(exist_ok=True)
        for name, filename in PAGES.items():
            page = BUILD / filename
            expected = math_elements(page)
            problems = unrendered_math(rendered_dom(browser, page), expected) if expected else []
            screenshot(browser, page, SHOTS / f"{name}.png")
            failures += [f"{filename}: {p}" for p in problems]
            print(
                f"{filename}: {expected} formulas, {'all rendered' if not problems else 'NOT rendered'}; "
                f"screenshot {SHOTS.relative_to(DOCS.parent) / (name + '.png')}"
            )
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
