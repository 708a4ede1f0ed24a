"""Checks a built documentation site (`bash dev.sh docs` runs it on site/): it opens from
disk, where a link to a folder shows the folder's listing ("Index of …"), not its page, so
every link between its pages names an existing file; no build script is published (a .py
file); and no page shows a machine's own path (/root/..., /home/NAME/..., /tmp/...).

    python tests/support/site_check.py SITE_DIR      # exits 1, naming each problem
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# a machine's own path in a page's text (the site's own URLs are relative)
MACHINE_PATH = re.compile(r"(?<![\w.~/-])(?:/root/|/home/\w+/|/tmp/\w|/work/\w)")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        for name, value in attrs:
            if value and ((tag == "a" and name == "href") or
                          (tag in ("script", "img") and name == "src") or
                          (tag == "link" and name == "href")):
                self.links.append(value)


def problems(site: Path) -> list[str]:
    """Every problem found in the built site `site`, one line each."""
    found = []
    for script in sorted(site.rglob("*.py")):
        found.append(f"{script.relative_to(site)}: a build script is published")
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html" and page.parent == site:  # a server's page: links from /
            continue
        text = page.read_text(errors="replace")
        name = page.relative_to(site)
        parser = _Links()
        parser.feed(text)
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("#", "mailto:", "data:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not parts.path:
                continue
            if target.is_dir():
                found.append(f"{name}: links to a folder, which a browser shows as its "
                             f"listing when the site is opened from disk: {link}")
            elif not target.exists():
                found.append(f"{name}: links to a missing file: {link}")
        for path in sorted(set(MACHINE_PATH.findall(_visible(text)))):
            found.append(f"{name}: shows a machine's own path ({path}...)")
    return found


def _visible(html: str) -> str:
    """The page's text without its tags and scripts (where a machine path would show)."""
    html = re.sub(r"<script\b.*?</script>", " ", html, flags=re.S | re.I)
    return re.sub(r"<[^>]+>", " ", html)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    site = Path(argv[0])
    found = problems(site)
    for line in found:
        print(f"site_check: {line}")
    if not found:
        print(f"site_check: {site}: every link names a file, no script, no machine path")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
