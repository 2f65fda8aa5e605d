"""The user documentation holds together: every relative link in the README and docs/ resolves,
and every file under docs/img and docs/results is linked from a page (those folders hold only
what a page shows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# [text](target) and ![alt](target); the target up to whitespace or ')', anchors cut off
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path):
    """(line number, target path) of each relative link of a Markdown page, code skipped."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # (code spans are not links)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor on the same page
            out.append((n, target.split("#", 1)[0]))
    return out


def test_the_link_finder_sees_links_and_skips_code_and_urls(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "see [a](a.md#x) and ![img](img/b.png) and [web](https://x.org) and [top](#top) and `k[g](*a)`\n"
        "```\n[not](a link.md)\n```\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(1, "a.md"), (1, "img/b.png")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = [f"{page.relative_to(ROOT)}:{n}: {t}" for n, t in relative_links(page) if not (page.parent / t).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_result_and_image_is_linked_from_a_page():
    linked = {(page.parent / t).resolve() for page in PAGES for _, t in relative_links(page)}
    files = [p for d in ("docs/img", "docs/results") for p in (ROOT / d).rglob("*") if p.is_file()]
    orphans = [
        str(p.relative_to(ROOT)) for p in files if p.resolve() not in linked and p.parent.resolve() not in linked
    ]
    assert not orphans, "files no page links to (link them, or remove them):\n" + "\n".join(sorted(orphans))
