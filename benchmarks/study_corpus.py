"""Build an English natural-language text corpus from Debian packages, for the numerics study.

What: a JSON-lines file ``OUT/corpus.jsonl`` (one document a line, ``{"text": ..., "source":
"<package>:<path>"}``), ``OUT/SOURCES.md`` (each package, its exact version, its licence as its
``/usr/share/doc/<pkg>/copyright`` states it, documents and bytes), ``OUT/licenses/`` (those
copyright files, verbatim) and, with ``--xz``, ``OUT/corpus.jsonl.xz``. The trainer reads it as::

    nemo-fp8-train data=jsonl data.paths=[OUT/corpus.jsonl]

Why: the trainer's default corpus is the Python standard library's source code. A numerics study
(a ~150M-parameter Llama with byte-level tokens, ~40M tokens a run) wants mostly natural-language
prose, several times larger than one run's token budget so that no run repeats text, from sources
with clear licences that every Debian machine can fetch with its own package manager (no data
set download from the internet). The default mix gives about 48 MB of UTF-8 text (Debian 12's
package versions: 3,281 documents, ~47M byte tokens for training; 11.6 MB as .xz, well under the
64 MiB a file may carry to a GPU machine) in about 15 s, plus about a minute for ``--xz``.

Sources (the defaults; ``--packages`` picks others from the same list):

- ``linux-doc-6.1``: the Linux kernel's documentation, GPL-2.0. Its reStructuredText sources
  (``Documentation/**/*.rst.gz`` and the ``*.txt.gz`` prose files); translations (not English),
  devicetree bindings and the ABI listings (structured, not prose) are left out; the HTML
  build is not used.
- ``python3.11-doc``: the Python documentation, PSF licence. Its reStructuredText sources
  (``html/_sources/**/*.rst.txt``), not the HTML; the changelog and the licence page are left out.
- ``bible-kjv-text``: the King James Bible (1611; public domain, the package is GPL-2+). Its text
  is in the package's own compressed format, so the package's reader ``bible`` (from the
  ``bible-kjv`` package, downloaded alongside and only run, never included) prints it; one
  document a book.
- ``dict-gcide``: GCIDE, the GNU Collaborative International Dictionary of English (Webster's
  1913 with additions), GPL-2+. Entries grouped into ~64 KB documents; the per-entry source tags
  (``[1913 Webster]``, ``[PJC]``, ...) are dropped. It has ~35 MB; capped at 15 MB by default.
- ``debian-handbook``: The Debian Administrator's Handbook, English HTML, GPL-2+ or CC-BY-SA-3.0.
  Converted with ``html.parser``; navigation (header/footer links, tables of contents, index and
  search pages) is dropped.

Also available: ``fortunes``, ``fortunes-min`` (fortune cookies, BSD; quotations of mixed
provenance, so not in the default mix), ``debian-reference-en`` (Debian Reference, GPL-2+;
mostly command tables), and any other ``linux-doc-X.Y`` / ``python3.X-doc``.

How: ``apt-get download`` fetches the .deb files into a work folder (or ``--debs DIR`` takes
already downloaded ones), ``dpkg-deb -x`` extracts them, each document is converted to plain
text (reStructuredText markup simplified, HTML stripped, gzip read), documents that are mostly
code (``--max-code-fraction``) or shorter than ``--min-chars`` are dropped, exact duplicates are
kept once, and each package is capped at ``--max-mb`` MB of text (default 20, the dictionary
15): documents are taken in the order of a hash of their source name (an even, deterministic
sample across the package) and written in sorted path order. Packages are processed in name
order. The output is a function of the package versions and the options alone: the same
versions give the same bytes (its sha256 is printed).

Usage::

    python benchmarks/study_corpus.py --out /data/study_corpus --xz
    python benchmarks/study_corpus.py --out /tmp/c --packages python3.11-doc bible-kjv-text
    python benchmarks/study_corpus.py --out /tmp/c --debs /tmp/debs     # offline, from .deb files

Exit status: 0 done; 1 a package could not be downloaded, extracted or converted; 2 bad
arguments or a missing tool.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import html.parser
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

DEFAULT_PACKAGES = ("linux-doc-6.1", "python3.11-doc", "bible-kjv-text", "dict-gcide", "debian-handbook")
#: per-package caps in MB of text ("*" = every package not named); the dictionary is capped lower
#: so that it stays under a third of the corpus, the rest of the mix being prose
DEFAULT_MAX_MB: Dict[str, float] = {"*": 20.0, "dict-gcide": 15.0}
DEFAULT_MAX_CODE_FRACTION = 0.5
DEFAULT_MIN_CHARS = 200
GCIDE_DOC_BYTES = 64 * 1024


class CorpusError(RuntimeError):
    """A failure the user can act on; the message says what to do."""


class MissingToolError(CorpusError):
    """A program the build needs (apt-get, dpkg-deb) is not installed."""


# --------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_BLANKS = re.compile(r"\n{3,}")


def decode_bytes(data: bytes) -> str:
    """UTF-8 text, else Windows-1252 (a stray curly quote), else Latin-1; never fails."""
    for enc in ("utf-8", "cp1252"):
        try:
            return data.decode(enc)
        except UnicodeDecodeError:
            pass
    return data.decode("latin-1")


def read_maybe_gzip(path: Path) -> bytes:
    """The bytes of ``path``, gunzipped when it is gzip data (``.gz``, dictzip ``.dz``)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data


def normalize_text(text: str) -> str:
    """Unix newlines, no control characters, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip("\n")


# --------------------------------------------------------------------------------------------
# reStructuredText -> text
# --------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([A-Za-z][\w:.+-]*)::(?:\s+(.*))?$")
_EXPLICIT = re.compile(r"^(\s*)\.\.(\s|$)")
_FOOTNOTE = re.compile(r"^\s*\.\.\s+\[([^\]]+)\]\s*(.*)$")
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
_TABLE_BORDER = re.compile(r"^\s*[+=|-][-=+|: ]*[-=+]\s*$")
_OPTION_LINE = re.compile(r"^\s*:[\w -]+:(\s.*)?$")
_FIELD = re.compile(r"^(\s*):([\w .()-]+):(\s.*|)$")

# directives whose whole block is dropped (navigation, metadata, generated or hidden content)
_RST_DROP = {
    "toctree",
    "index",
    "highlight",
    "contents",
    "include",
    "literalinclude",
    "kernel-doc",
    "kernel-abi",
    "kernel-feat",
    "kernel-include",
    "image",
    "raw",
    "only",
    "ifconfig",
    "tabularcolumns",
    "module",
    "currentmodule",
    "moduleauthor",
    "sectionauthor",
    "program",
    "audit-event",
    "audit-event-table",
    "testsetup",
    "testcleanup",
    "meta",
    "default-role",
    "role",
    "cssclass",
    "sectnum",
    "header",
    "footer",
    "title",
    "maxdepth",
    "availability",
    "c:namespace",
    "c:namespace-push",
    "c:namespace-pop",
    "cpp:namespace",
    "py:module",
    "py:currentmodule",
    "flat-table",
    "list-table",
    "csv-table",
    "table",
    "graphviz",
    "kernel-figure",
    "kernel-render",
    "math",
    "productionlist",
    "autosummary",
    "automodule",
    "autoclass",
    "autofunction",
    "limited-api-list",
    "code-block-caption",
    "miscnews",
    "changes",
    "impl-detail-none",
}
# directives whose block is code (kept, counted as code)
_RST_CODE = {"code-block", "code", "sourcecode", "doctest", "testcode", "testoutput", "parsed-literal", "literal"}
# directives that label their content
_RST_ADMONITIONS = {
    "note": "Note",
    "warning": "Warning",
    "caution": "Caution",
    "attention": "Attention",
    "danger": "Danger",
    "error": "Error",
    "hint": "Hint",
    "important": "Important",
    "tip": "Tip",
    "seealso": "See also",
    "impl-detail": "CPython implementation detail",
    "todo": "To do",
}
_RST_VERSION = {
    "versionadded": "New in version",
    "versionchanged": "Changed in version",
    "deprecated": "Deprecated since version",
    "deprecated-removed": "Deprecated since version",
}
# directives whose argument is a title over their content
_RST_TITLED = {"admonition", "rubric", "centered", "topic", "sidebar", "glossary", "epigraph", "container"}

_ROLE = re.compile(r":([A-Za-z][\w:.+-]*):`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_INTERPRETED = re.compile(r"(?<![\w`])`([^`]+)`(?![\w`])")
_STRONG = re.compile(r"(?<![\w*])\*\*(?=\S)(.+?)(?<=\S)\*\*(?![\w*])")
_EMPH = re.compile(r"(?<![\w*\\])\*(?=[^\s*])(.+?)(?<=[^\s*\\])\*(?![\w*])")
_FOOTREF = re.compile(r"\s?\[(?:#[\w-]*|\*|\d+)\]_")
_ROLE_TARGET = re.compile(r"^(.*?)\s*<[^<>]+>$")


def _role_text(m: "re.Match[str]") -> str:
    role, inner = m.group(1).lower(), m.group(2)
    t = _ROLE_TARGET.match(inner)
    if t and t.group(1):
        return t.group(1)
    inner = inner.lstrip("!")
    if role in ("pep", "rfc"):
        return f"{role.upper()} {inner}"
    if inner.startswith("~"):
        inner = inner[1:].rsplit(".", 1)[-1]
    return inner


def rst_inline(line: str) -> str:
    """Inline reStructuredText markup to plain text (roles, literals, links, emphasis)."""
    line = _ROLE.sub(_role_text, line)
    line = _LITERAL.sub(r"\1", line)
    line = _LINK.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = _INTERPRETED.sub(r"\1", line)
    line = _STRONG.sub(r"\1", line)
    line = _EMPH.sub(r"\1", line)
    line = _FOOTREF.sub("", line)
    line = line.replace("\\ ", "").replace("\\*", "*").replace("\\_", "_").replace("\\`", "`")
    return line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_end(lines: Sequence[str], start: int, indent: int) -> int:
    """Index after the block that starts at ``start``: blank lines or lines indented deeper than
    ``indent`` (trailing blank lines are not part of it)."""
    j = start
    last = start
    while j < len(lines):
        if lines[j].strip():
            if _indent(lines[j]) <= indent:
                break
            last = j + 1
        j += 1
    return last


def _dedent(lines: Sequence[str]) -> List[str]:
    ind = min((_indent(ln) for ln in lines if ln.strip()), default=0)
    return [ln[ind:] if ln.strip() else "" for ln in lines]


def _rst_lines(lines: List[str]) -> List[Tuple[str, bool]]:
    """Convert a block of rst lines; returns ``(line, is_code)`` pairs."""
    out: List[Tuple[str, bool]] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        stripped = line.strip()
        ind = _indent(line)
        if not stripped:
            out.append(("", False))
            i += 1
            continue
        m = _DIRECTIVE.match(line)
        if m:
            name = m.group(2).lower()
            arg = (m.group(3) or "").strip()
            j = _block_end(lines, i + 1, ind)
            body = lines[i + 1 : j]
            # directive options (":maxdepth: 2") sit right under the directive line
            k = 0
            while k < len(body) and body[k].strip() and _OPTION_LINE.match(body[k]):
                k += 1
            body = _dedent(body[k:])
            i = j
            short = name.split(":")[-1]
            if name in _RST_DROP or short in _RST_DROP:
                continue
            if name in _RST_CODE:
                out.append(("", False))
                out.extend((ln, True) for ln in body)
                out.append(("", False))
                continue
            if name in _RST_VERSION or name in _RST_ADMONITIONS or name in _RST_TITLED:
                arg = rst_inline(arg)
                if name in _RST_VERSION:  # "Changed in version 3.3: <body>"
                    head = f"{_RST_VERSION[name]} {arg}" + (":" if any(b.strip() for b in body) else ".")
                elif name in _RST_ADMONITIONS:  # "Note: <text>"
                    head = f"{_RST_ADMONITIONS[name]}: {arg}".rstrip()
                else:  # a title
                    head = arg
                out.append(("", False))
                if head:
                    out.append((head, False))
                out.extend(_rst_lines(body))
                out.append(("", False))
                continue
            if name in ("image", "figure"):
                out.extend(_rst_lines(body))
                continue
            # object descriptions (function::, c:function::, class::, option::, glossary:: ...):
            # the signature as a line of text, then the body
            out.append(("", False))
            if arg:
                out.append((rst_inline(arg), False))
            while body and body[0].strip():  # more signatures, up to the first blank line
                out.append((rst_inline(body.pop(0).strip()), False))
            out.extend(_rst_lines(body))
            out.append(("", False))
            continue
        if _EXPLICIT.match(line):
            # comment, hyperlink target, substitution definition or footnote
            j = _block_end(lines, i + 1, ind)
            fm = _FOOTNOTE.match(line)
            if fm:
                text = " ".join([fm.group(2)] + [ln.strip() for ln in lines[i + 1 : j] if ln.strip()])
                if text.strip():
                    out.append((rst_inline(text.strip()), False))
            i = j
            continue
        if _ADORNMENT.match(line) or _TABLE_BORDER.match(line):
            i += 1
            continue
        if stripped.startswith(">>>"):
            # a doctest paragraph: code up to the next blank line
            while i < n and lines[i].strip():
                out.append((lines[i], True))
                i += 1
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            # a paragraph introducing a literal block
            text = stripped[:-2].rstrip()
            if text:
                out.append((" " * ind + rst_inline(text) + ":", False))
            j = i + 1
            while j < n and not lines[j].strip():
                j += 1
            if j < n and _indent(lines[j]) > ind:
                end = _block_end(lines, j, ind)
                out.append(("", False))
                out.extend((ln, True) for ln in _dedent(lines[j:end]))
                out.append(("", False))
                i = end
            else:
                i += 1
            continue
        if stripped.startswith("|") and stripped.endswith("|") and stripped.count("|") >= 2:
            cells = [c.strip() for c in stripped.strip("|").split("|")]
            out.append((" ".join(rst_inline(c) for c in cells if c), False))
            i += 1
            continue
        fl = _FIELD.match(line)
        if fl:  # a field list item ":param x: text" -> "param x: text"
            line = f"{fl.group(1)}{fl.group(2)}:{fl.group(3)}"
        out.append((rst_inline(line), False))
        i += 1
    return out


@dataclasses.dataclass
class Converted:
    """A document's plain text and how much of it is code (literal blocks, ``<pre>``)."""

    text: str
    code_chars: int = 0

    @property
    def code_fraction(self) -> float:
        total = len(self.text.replace("\n", "").replace(" ", ""))
        return self.code_chars / total if total else 0.0


def rst_to_text(src: str) -> Converted:
    """reStructuredText (or plain text) to plain text, keeping prose and code samples.

    Titles stay as lines (their underlines go), inline markup is simplified, directives that
    hold navigation or metadata (toctree, index, kernel-doc, ...) and tables are dropped,
    admonitions are labelled ("Note: ..."), literal blocks and doctests are kept and counted as
    code.
    """
    lines = src.expandtabs(8).replace("\r\n", "\n").split("\n")
    pairs = _rst_lines(lines)
    code = sum(len(ln.replace(" ", "")) for ln, c in pairs if c)
    return Converted(normalize_text("\n".join(ln for ln, _ in pairs)), code)


# --------------------------------------------------------------------------------------------
# HTML -> text
# --------------------------------------------------------------------------------------------

_HTML_SKIP_TAGS = {
    "head",
    "script",
    "style",
    "nav",
    "noscript",
    "template",
    "svg",
    "button",
    "form",
    "select",
    "header",
    "footer",
    "iframe",
    "object",
    "math",
}
_HTML_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "param",
    "source",
    "track",
    "wbr",
}
# elements that start a paragraph (a blank line) or a line
_HTML_PARAGRAPH = {
    "p",
    "div",
    "section",
    "article",
    "main",
    "aside",
    "blockquote",
    "pre",
    "table",
    "ul",
    "ol",
    "dl",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "figure",
    "figcaption",
    "caption",
    "hr",
    "title",
    "body",
    "html",
    "address",
    "details",
    "summary",
}
_HTML_LINE = {"li", "dt", "dd", "tr", "br"}
_HTML_CELL = {"td", "th"}
_PARA, _LINE = "\x03", "\x02"  # break markers, resolved after the page is parsed
# class or id tokens of navigation, sidebars and other page furniture (Sphinx, DocBook/Publican,
# Read the Docs); note DocBook's "sidebar" class is content (a boxed aside), so it is not here
_HTML_SKIP_CLASSES = {
    "sphinxsidebar",
    "sphinxsidebarwrapper",
    "related",
    "footer",
    "headerlink",
    "docnav",
    "toc",
    "toctree-wrapper",
    "navheader",
    "navfooter",
    "breadcrumbs",
    "wy-nav-side",
    "rst-versions",
    "navigation",
    "navbar",
    "nav",
    "searchbox",
    "mobile-nav",
    "menu",
    "skip-link",
    "copyright",
    "banner",
    "sidebar-tree",
    "toc-drawer",
    "reference-internal-toc",
    "indexterm",
    "viewcode-link",
}
_HTML_SKIP_IDS = {
    "banner",
    "title",
    "searchbox",
    "sidebar",
    "navigation",
    "header",
    "footer",
    "menu",
    "nav",
    "toc",
    "breadcrumbs",
    "search-results",
}
_HTML_MAIN_ROLES = {"main"}
_HTML_MAIN_CLASSES = {"body", "bodywrapper"}
# pages that are navigation only (Sphinx, DocBook): skipped by file name
NAV_PAGE = re.compile(
    r"^(genindex(-.*)?|py-modindex|modindex|search|index|ix\d*|contents|glossary-index)"
    r"(\.[\w-]+)?\.html?$"
)


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: List[Tuple[str, bool, bool, bool]] = []  # (tag, skip, main, pre)
        self.skip = 0
        self.main = 0
        self.pre = 0
        self.chunks: List[Tuple[str, bool, bool]] = []  # (text, in_main, in_pre)
        self.saw_main = False

    def _classes(self, attrs) -> Tuple[set, str, str]:
        a = {k: (v or "") for k, v in attrs}
        return set(a.get("class", "").split()), a.get("id", ""), a.get("role", "")

    def _break(self, tag: str) -> None:
        if tag in _HTML_PARAGRAPH:
            self.chunks.append((_PARA, self.main > 0, False))
        elif tag in _HTML_LINE:
            self.chunks.append((_LINE, self.main > 0, False))
        elif tag in _HTML_CELL:
            self.chunks.append((" ", self.main > 0, False))

    def handle_starttag(self, tag, attrs):
        tag = tag.lower()
        self._break(tag)
        if tag in _HTML_VOID:
            return
        classes, ident, role = self._classes(attrs)
        skip = (
            tag in _HTML_SKIP_TAGS
            or bool(classes & _HTML_SKIP_CLASSES)
            or ident in _HTML_SKIP_IDS
            or role in ("navigation", "search", "banner", "contentinfo")
        )
        main = role in _HTML_MAIN_ROLES or tag == "main" or bool(classes & _HTML_MAIN_CLASSES)
        pre = tag == "pre"
        self.stack.append((tag, skip, main, pre))
        self.skip += skip
        self.main += main
        self.pre += pre
        if main:
            self.saw_main = True
        if tag == "li" and not self.skip:
            self.chunks.append(("- ", self.main > 0, False))

    def handle_startendtag(self, tag, attrs):
        self._break(tag.lower())

    def handle_endtag(self, tag):
        tag = tag.lower()
        if tag in _HTML_VOID:
            return
        # close up to the matching open tag (HTML often leaves <p>, <li> open)
        for k in range(len(self.stack) - 1, -1, -1):
            if self.stack[k][0] == tag:
                for _, skip, main, pre in self.stack[k:]:
                    self.skip -= skip
                    self.main -= main
                    self.pre -= pre
                del self.stack[k:]
                break
        self._break(tag)

    def handle_data(self, data):
        if self.skip:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
        self.chunks.append((data, self.main > 0, self.pre > 0))


def html_to_text(src: str) -> Converted:
    """HTML to plain text with the standard library's ``html.parser``.

    Scripts, styles, ``<head>``, ``<nav>``, header/footer and elements whose class or id marks
    navigation (Sphinx sidebars and "related" bars, DocBook ``docnav``/``toc``, header links) are
    dropped. When the page marks its main content (``role="main"``, ``<main>``, Sphinx's
    ``div.body``), only that is kept. ``<pre>`` keeps its line breaks and counts as code.
    """
    p = _TextExtractor()
    p.feed(src)
    p.close()
    parts: List[str] = []
    code = 0
    for t, main, pre in p.chunks:
        if p.saw_main and not main:
            continue
        if pre:
            code += len(t.replace("\n", "").replace(" ", ""))
            t = t.replace(" ", "\x01").replace("\t", "\x01" * 8)  # keep <pre> indentation through strip()
        parts.append(t)
    text = re.sub(r"[ \t]*[\x02\x03][\x02\x03 \t]*", lambda m: "\n\n" if _PARA in m.group() else "\n", "".join(parts))
    lines = [line.strip(" \t") for line in text.split("\n")]
    text = "\n".join(line for line in lines if line != "-").replace("\x01", " ")
    return Converted(normalize_text(text), code)


# --------------------------------------------------------------------------------------------
# Per-package extraction: the extracted tree -> (path, Converted) in sorted path order
# --------------------------------------------------------------------------------------------

Doc = Tuple[str, Converted]


def _files(root: Path, base: str, patterns: Sequence[str]) -> List[Tuple[str, Path]]:
    """Regular files under ``root/base`` matching any glob in ``patterns``, as (posix path
    relative to ``root``, path), sorted by that relative path."""
    top = root / base
    if not top.is_dir():
        return []
    found = {}
    for pat in patterns:
        for p in top.glob(pat):
            if p.is_file() and not p.is_symlink():
                found[p.relative_to(root).as_posix()] = p
    return sorted(found.items())


_LINUX_SKIP = re.compile(
    r"/Documentation/(translations|devicetree/bindings|ABI|features|output|sphinx|"
    r"sphinx-static|netlink/specs)/"
)
_LINUX_SKIP_NAMES = re.compile(r"/(dontdiff|Kconfig|conf\.py|docutils\.conf|Makefile|\.[^/]*)(\.gz)?$")


def extract_linux_doc(root: Path, pkg: str) -> Iterator[Doc]:
    """Linux kernel documentation: ``Documentation/**/*.rst[.gz]`` and ``*.txt[.gz]``."""
    base = f"usr/share/doc/{pkg}/Documentation"
    files = _files(root, base, ["**/*.rst.gz", "**/*.rst", "**/*.txt.gz", "**/*.txt"])
    if not files:
        raise CorpusError(
            f"{pkg}: no Documentation/**/*.rst(.gz) under /{base} in the package; is this a linux-doc-X.Y package?"
        )
    for rel, p in files:
        if _LINUX_SKIP.search("/" + rel) or _LINUX_SKIP_NAMES.search(rel):
            continue
        yield rel, rst_to_text(decode_bytes(read_maybe_gzip(p)))


_PYDOC_SKIP = re.compile(
    r"/_sources/(whatsnew/changelog|license|contents|bugs|copyright|about|"
    r"genindex|py-modindex|search)\.rst\.txt$"
)


def extract_python_doc(root: Path, pkg: str) -> Iterator[Doc]:
    """Python documentation: the rst sources in ``html/_sources``; the HTML when there are none."""
    m = re.match(r"python(\d+\.\d+)-doc$", pkg)
    ver = m.group(1) if m else ""
    bases = [f"usr/share/doc/python{ver}/html", f"usr/share/doc/{pkg}/html"]
    for base in bases:
        files = _files(root, base + "/_sources", ["**/*.rst.txt", "**/*.txt"])
        if files:
            for rel, p in files:
                if _PYDOC_SKIP.search("/" + rel):
                    continue
                yield rel, rst_to_text(decode_bytes(read_maybe_gzip(p)))
            return
    for base in bases:
        files = _files(root, base, ["**/*.html"])
        if files:
            for rel, p in files:
                if "/_static/" in rel or NAV_PAGE.match(rel.rsplit("/", 1)[-1]):
                    continue
                yield rel, html_to_text(decode_bytes(p.read_bytes()))
            return
    raise CorpusError(
        f"{pkg}: found neither html/_sources/*.rst.txt nor HTML pages under /usr/share/doc/python{ver}/html"
    )


def extract_html_book(root: Path, pkg: str, base: str) -> Iterator[Doc]:
    files = _files(root, base, ["*.html"])
    if not files:
        raise CorpusError(f"{pkg}: no HTML pages under /{base}")
    for rel, p in files:
        if NAV_PAGE.match(rel.rsplit("/", 1)[-1]):
            continue
        yield rel, html_to_text(decode_bytes(p.read_bytes()))


def extract_debian_handbook(root: Path, pkg: str) -> Iterator[Doc]:
    """The Debian Administrator's Handbook, English HTML (``html/en-US/*.html``)."""
    yield from extract_html_book(root, pkg, f"usr/share/doc/{pkg}/html/en-US")


def extract_debian_reference(root: Path, pkg: str) -> Iterator[Doc]:
    """Debian Reference: its plain-text edition when shipped, else its HTML chapters."""
    txt = _files(root, "usr/share/debian-reference", ["*.en.txt.gz", "*.en.txt"])
    if txt:
        for rel, p in txt:
            yield rel, Converted(normalize_text(decode_bytes(read_maybe_gzip(p))))
        return
    yield from extract_html_book(root, pkg, "usr/share/debian-reference")


_FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}


def extract_fortunes(root: Path, pkg: str) -> Iterator[Doc]:
    """Fortune cookie files (one document a file, the cookies separated by blank lines); the
    ASCII-art files are left out."""
    files = _files(root, "usr/share/games/fortunes", ["*"])
    if not files:
        raise CorpusError(f"{pkg}: no fortune files under /usr/share/games/fortunes")
    for rel, p in files:
        name = rel.rsplit("/", 1)[-1]
        if "." in name or name in _FORTUNE_SKIP:
            continue
        text = decode_bytes(p.read_bytes())
        cookies = [c.strip("\n") for c in re.split(r"(?m)^%\s*$", text)]
        yield rel, Converted(normalize_text("\n\n".join(c for c in cookies if c.strip())))


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
_GCIDE_SOURCE_TAG = re.compile(
    r"(?m)^[ \t]*\[[^\]\n]*(Webster|WordNet|PJC|Century|Chambers|Johnson|"
    r"Stormonth|Craig|Thesaurus|Source)[^\]\n]*\][ \t]*\n?"
)


def _b64num(s: str) -> int:
    v = 0
    for c in s:
        v = v * 64 + _B64[c]
    return v


def dictd_entries(data: bytes, index: str) -> List[bytes]:
    """The entries of a dictd database (``.dict`` bytes and its ``.index`` text), in file order,
    each once, without the ``00-database-*`` metadata entries."""
    spans = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        spans.add((_b64num(parts[1]), _b64num(parts[2])))
    return [data[o : o + n] for o, n in sorted(spans)]


def extract_gcide(root: Path, pkg: str, doc_bytes: int = GCIDE_DOC_BYTES) -> Iterator[Doc]:
    """GCIDE: dictionary entries, grouped in file order into documents of about ``doc_bytes``."""
    base = root / "usr/share/dictd"
    dz = sorted(base.glob("gcide.dict.dz")) or sorted(base.glob("gcide.dict"))
    idx = base / "gcide.index"
    if not dz or not idx.is_file():
        raise CorpusError(f"{pkg}: /usr/share/dictd/gcide.dict.dz or gcide.index missing from the package")
    rel = dz[0].relative_to(root).as_posix()
    entries = dictd_entries(read_maybe_gzip(dz[0]), decode_bytes(idx.read_bytes()))
    group: List[str] = []
    size, k = 0, 0
    for e in entries:
        text = _GCIDE_SOURCE_TAG.sub("", decode_bytes(e)).strip("\n")
        if not text.strip():
            continue
        group.append(text)
        size += len(text) + 2
        if size >= doc_bytes:
            yield f"{rel}#{k:05d}", Converted(normalize_text("\n\n".join(group)))
            group, size, k = [], 0, k + 1
    if group:
        yield f"{rel}#{k:05d}", Converted(normalize_text("\n\n".join(group)))


BIBLE_BOOKS = (
    "Genesis",
    "Exodus",
    "Leviticus",
    "Numbers",
    "Deuteronomy",
    "Joshua",
    "Judges",
    "Ruth",
    "1 Samuel",
    "2 Samuel",
    "1 Kings",
    "2 Kings",
    "1 Chronicles",
    "2 Chronicles",
    "Ezra",
    "Nehemiah",
    "Esther",
    "Job",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Song of Solomon",
    "Isaiah",
    "Jeremiah",
    "Lamentations",
    "Ezekiel",
    "Daniel",
    "Hosea",
    "Joel",
    "Amos",
    "Obadiah",
    "Jonah",
    "Micah",
    "Nahum",
    "Habakkuk",
    "Zephaniah",
    "Haggai",
    "Zechariah",
    "Malachi",
    "Matthew",
    "Mark",
    "Luke",
    "John",
    "Acts",
    "Romans",
    "1 Corinthians",
    "2 Corinthians",
    "Galatians",
    "Ephesians",
    "Philippians",
    "Colossians",
    "1 Thessalonians",
    "2 Thessalonians",
    "1 Timothy",
    "2 Timothy",
    "Titus",
    "Philemon",
    "Hebrews",
    "James",
    "1 Peter",
    "2 Peter",
    "1 John",
    "2 John",
    "3 John",
    "Jude",
    "Revelation",
)
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*)$")


def bible_books(dump: str) -> List[Tuple[str, str]]:
    """Split the reader's one-verse-a-line dump (``Ge1:1 In the beginning ...``) into books:
    ``(book name, text)`` with a title line, "Chapter N" headings and numbered verses."""
    books: List[Tuple[str, List[Tuple[int, int, str]]]] = []
    last_abbr = None
    for line in dump.splitlines():
        m = _VERSE.match(line.strip())
        if not m:
            if line.strip() and books:  # a wrapped verse continues
                ch, vs, t = books[-1][1][-1]
                books[-1][1][-1] = (ch, vs, t + " " + line.strip())
            continue
        abbr, ch, vs, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip()
        if abbr != last_abbr:
            books.append((abbr, []))
            last_abbr = abbr
        books[-1][1].append((ch, vs, text))
    if len(books) != len(BIBLE_BOOKS):
        raise CorpusError(f"bible-kjv-text: the reader printed {len(books)} books, expected {len(BIBLE_BOOKS)}")
    out = []
    for name, (_, verses) in zip(BIBLE_BOOKS, books):
        lines = [name]
        chapter = None
        for ch, vs, text in verses:
            if ch != chapter:
                lines += ["", f"Chapter {ch}", ""]
                chapter = ch
            lines.append(f"{vs} {text}")
        out.append((name, "\n".join(lines)))
    return out


def extract_bible(root: Path, pkg: str) -> Iterator[Doc]:
    """The King James Bible, printed by the ``bible`` reader of ``bible-kjv`` (extracted beside
    it), one document a book."""
    data_dir = root / "usr/lib"
    reader = root / "usr/bin/bible"
    if not (data_dir / "bible.data").is_file():
        raise CorpusError(f"{pkg}: /usr/lib/bible.data missing from the package")
    if not reader.is_file():
        raise CorpusError(
            f"{pkg}: the reader /usr/bin/bible (package bible-kjv) was not extracted; with --debs, "
            "put bible-kjv_*.deb beside bible-kjv-text_*.deb (apt-get download bible-kjv)"
        )
    try:
        r = subprocess.run(
            [str(reader), "-f", "-p", str(data_dir), "Gen1:1-Rev22:21"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "TERM": "dumb", "HOME": str(root)},
        )
    except OSError as e:
        raise CorpusError(
            f"{pkg}: cannot run the bible-kjv reader {reader} ({e}); it is a binary for this "
            "machine's architecture and needs libreadline8 (apt-get install libreadline8), "
            "or leave bible-kjv-text out of --packages"
        ) from None
    if r.returncode != 0 or not r.stdout:
        raise CorpusError(
            f"{pkg}: the bible-kjv reader failed (exit {r.returncode}): "
            f"{r.stderr.decode(errors='replace').strip()[:500]}; needs libreadline8, "
            "or leave bible-kjv-text out of --packages"
        )
    for name, text in bible_books(decode_bytes(r.stdout)):
        yield (
            f"usr/lib/bible.data#{BIBLE_BOOKS.index(name) + 1:02d}-{name.replace(' ', '_')}",
            Converted(normalize_text(text)),
        )


@dataclasses.dataclass(frozen=True)
class PackageSpec:
    """How one Debian package becomes documents."""

    name: str
    extract: Callable[[Path, str], Iterator[Doc]]
    licence_note: str
    what: str
    helpers: Tuple[str, ...] = ()  # other packages extracted into the same tree (tools, never text)


_SPECS: Dict[str, PackageSpec] = {
    "dict-gcide": PackageSpec(
        "dict-gcide",
        extract_gcide,
        "GPL-2+ (GCIDE; Webster's 1913 is public domain)",
        "GNU Collaborative International Dictionary of English, entries in ~64 KB groups",
    ),
    "bible-kjv-text": PackageSpec(
        "bible-kjv-text",
        extract_bible,
        "KJV text public domain (copyright expired); package GPL-2+",
        "King James Bible, one document a book",
        helpers=("bible-kjv",),
    ),
    "debian-handbook": PackageSpec(
        "debian-handbook",
        extract_debian_handbook,
        "GPL-2+ or CC-BY-SA-3.0",
        "The Debian Administrator's Handbook, English HTML converted to text",
    ),
    "debian-reference-en": PackageSpec(
        "debian-reference-en", extract_debian_reference, "GPL-2+", "Debian Reference (English), plain-text edition"
    ),
    "fortunes": PackageSpec(
        "fortunes", extract_fortunes, "BSD (fortune-mod); quotations of mixed provenance", "fortune cookie files"
    ),
    "fortunes-min": PackageSpec(
        "fortunes-min",
        extract_fortunes,
        "BSD (fortune-mod); quotations of mixed provenance",
        "fortune cookie files (fortunes, literature, riddles)",
    ),
}


def package_spec(name: str) -> PackageSpec:
    if name in _SPECS:
        return _SPECS[name]
    if re.fullmatch(r"linux-doc-\d+\.\d+", name):
        return PackageSpec(
            name,
            extract_linux_doc,
            "GPL-2.0 (Linux kernel documentation)",
            "Linux kernel documentation, reStructuredText sources (English; no translations, "
            "devicetree bindings or ABI listings)",
        )
    if re.fullmatch(r"python3\.\d+-doc", name):
        return PackageSpec(
            name,
            extract_python_doc,
            "PSF-2.0 (Python Software Foundation License)",
            "Python documentation, reStructuredText sources (no changelog or licence page)",
        )
    raise CorpusError(f"package {name!r} is not supported; choose from: {', '.join(supported_packages())}")


def supported_packages() -> List[str]:
    return ["linux-doc-X.Y (e.g. linux-doc-6.1)", "python3.X-doc (e.g. python3.11-doc)"] + sorted(_SPECS)


# --------------------------------------------------------------------------------------------
# Debian packages: download, identify, extract, licence
# --------------------------------------------------------------------------------------------


def _need_tool(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise MissingToolError(f"{tool} not found on PATH; {hint}")
    return path


def deb_fields(deb: Path) -> Dict[str, str]:
    """``Package``, ``Version`` and ``Architecture`` of a .deb (``dpkg-deb -f``)."""
    r = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Package", "Version", "Architecture"], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise CorpusError(f"{deb}: not a readable .deb ({r.stderr.strip()})")
    fields = {}
    for line in r.stdout.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip()] = v.strip()
    return fields


def find_debs(folder: Path, names: Sequence[str]) -> Dict[str, Path]:
    """The .deb of each package in ``names`` found in ``folder``; an error names what is missing."""
    by_name: Dict[str, List[Path]] = {}
    for deb in sorted(folder.glob("*.deb")):
        by_name.setdefault(deb_fields(deb).get("Package", ""), []).append(deb)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise CorpusError(
            f"no .deb for {', '.join(missing)} in {folder}; download them with "
            f"`apt-get download {' '.join(missing)}` (in that folder), or drop them from --packages"
        )
    dup = {n: by_name[n] for n in names if len(by_name[n]) > 1}
    if dup:
        lst = "; ".join(f"{n}: {', '.join(p.name for p in ps)}" for n, ps in dup.items())
        raise CorpusError(f"several .deb files for the same package in {folder} ({lst}); keep one of each")
    return {n: by_name[n][0] for n in names}


def apt_download(names: Sequence[str], folder: Path) -> Dict[str, Path]:
    """``apt-get download`` each package into ``folder``."""
    _need_tool(
        "apt-get",
        "this is not a Debian-like system: download the .deb files elsewhere "
        "(`apt-get download PACKAGE`) and pass their folder with --debs DIR",
    )
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # lets apt's sandbox user write there (else apt warns and downloads as root)
    print(f"[download] apt-get download {' '.join(names)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(["apt-get", "download", *names], cwd=folder, capture_output=True, text=True)
    if r.returncode != 0:
        err = (r.stderr or r.stdout).strip()
        hint = ""
        if "Unable to locate" in err or "has no installation candidate" in err or "No packages found" in err:
            hint = " The package lists may be missing or old: run `apt-get update` (as root), or pass --apt-update."
        raise CorpusError(
            f"apt-get download failed: {err[-800:]}.{hint} Or download the .deb files elsewhere "
            "and pass their folder with --debs DIR."
        )
    debs = find_debs(folder, names)
    total = sum(p.stat().st_size for p in debs.values())
    print(f"[download] {len(debs)} .deb files, {total / 1e6:.1f} MB in {time.perf_counter() - t0:.1f}s", flush=True)
    return debs


def extract_deb(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True)
    if r.returncode != 0:
        raise CorpusError(f"dpkg-deb -x {deb} failed: {r.stderr.strip()}")


def detect_licence(copyright_text: str) -> str:
    """A short licence name from a Debian copyright file: the ``License`` of the ``Files: *``
    paragraph of a machine-readable (DEP-5) file, else the first licence the text names."""
    t = copyright_text
    if re.match(r"\s*Format:", t):
        for para in re.split(r"\n\s*\n", t):
            if re.search(r"(?m)^Files:\s*\*\s*$", para):
                m = re.search(r"(?m)^License:\s*(.+)$", para)
                if m:
                    return m.group(1).strip()
    flat = re.sub(r"\s+", " ", t)
    gpl = re.search(
        r"(GNU (Lesser |Library )?General Public License|\bL?GPL\b)[^.]{0,80}?version (\d)"
        r"(,? or \(at your option\) any later| or later|\+)?",
        flat,
        re.I,
    )
    if re.search(r"\bPython (Software Foundation )?License\b", flat):
        return "PSF-2.0"
    if gpl:
        base = "LGPL" if gpl.group(2) or flat[gpl.start() : gpl.start() + 4] == "LGPL" else "GPL"
        return f"{base}-{gpl.group(3)}{'+' if gpl.group(4) else ''}"
    if re.search(r"BSD copyright|Redistribution and use in source and binary forms", flat):
        return "BSD"
    if re.search(r"public domain", flat, re.I):
        return "public domain"
    return "unknown (see licenses/)"


# --------------------------------------------------------------------------------------------
# Building the corpus
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackageResult:
    name: str
    version: str
    deb: str
    deb_sha256: str
    licence: str
    licence_note: str
    what: str
    helpers: List[str]
    docs: int = 0
    bytes: int = 0
    seen_docs: int = 0
    seen_bytes: int = 0
    dropped_code: int = 0
    dropped_short: int = 0
    dropped_dup: int = 0
    dropped_cap: int = 0
    seconds: float = 0.0


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cap_key(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def select_documents(docs: List[Tuple[str, str]], max_bytes: Optional[int]) -> Tuple[List[Tuple[str, str]], int]:
    """At most ``max_bytes`` of UTF-8 text from ``docs`` (``(source, text)``, sorted by source):
    documents taken in the order of a hash of their source, each one that would pass the cap
    skipped (an even sample across the package, the same for the same inputs), returned in
    source order, with the number left out."""
    if max_bytes is None or sum(len(t.encode("utf-8")) for _, t in docs) <= max_bytes:
        return docs, 0
    kept, total = set(), 0
    for src, text in sorted(docs, key=lambda d: _cap_key(d[0])):
        n = len(text.encode("utf-8"))
        if total + n > max_bytes:
            continue
        kept.add(src)
        total += n
    return [d for d in docs if d[0] in kept], len(docs) - len(kept)


def convert_package(
    spec: PackageSpec,
    root: Path,
    result: PackageResult,
    *,
    max_bytes: Optional[int],
    max_code_fraction: float,
    min_chars: int,
    seen: set,
    progress_every: int = 500,
) -> List[Tuple[str, str]]:
    """The kept documents of one extracted package, as ``(source, text)`` in source order."""
    docs: List[Tuple[str, str]] = []
    t0 = time.perf_counter()
    k = 0
    for k, (rel, conv) in enumerate(spec.extract(root, spec.name), 1):
        result.seen_docs += 1
        result.seen_bytes += len(conv.text.encode("utf-8"))
        if len(conv.text) < min_chars:
            result.dropped_short += 1
        elif conv.code_fraction > max_code_fraction:
            result.dropped_code += 1
        else:
            digest = hashlib.sha256(conv.text.encode("utf-8")).digest()
            if digest in seen:
                result.dropped_dup += 1
            else:
                seen.add(digest)
                docs.append((f"{spec.name}:{rel}", conv.text))
        if progress_every and k % progress_every == 0:
            print(f"  {spec.name}: {k} documents converted ({time.perf_counter() - t0:.0f}s)", flush=True)
    docs.sort(key=lambda d: d[0])
    docs, result.dropped_cap = select_documents(docs, max_bytes)
    result.docs = len(docs)
    result.bytes = sum(len(t.encode("utf-8")) for _, t in docs)
    return docs


def write_jsonl(path: Path, docs: Iterable[Tuple[str, str]]) -> int:
    """Write ``{"text", "source"}`` records, one a line (UTF-8, not ASCII-escaped); returns bytes."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "wb") as f:
        for source, text in docs:
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            b = line.encode("utf-8")
            f.write(b)
            n += len(b)
    os.replace(tmp, path)
    return n


def write_xz(src: Path, dst: Path, preset: int) -> int:
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, "rb") as fi, lzma.open(tmp, "wb", preset=preset, check=lzma.CHECK_CRC64) as fo:
        for block in iter(lambda: fi.read(1 << 20), b""):
            fo.write(block)
    os.replace(tmp, dst)
    return dst.stat().st_size


def sources_md(
    results: Sequence[PackageResult], sha256: str, jsonl_bytes: int, options: str, xz: Optional[Tuple[str, int]] = None
) -> str:
    lines = [
        "# Study corpus: sources",
        "",
        "Built by `benchmarks/study_corpus.py` from Debian packages; one JSON object a line in "
        "`corpus.jsonl` (`text`, `source` = `<package>:<path in the package>`).",
        "",
        f"- corpus.jsonl: {jsonl_bytes:,} bytes, sha256 `{sha256}`",
    ]
    if xz:
        lines.append(f"- corpus.jsonl.xz: {xz[1]:,} bytes, sha256 `{xz[0]}`")
    lines += [
        f"- options: `{options}`",
        "- read by the trainer with `nemo-fp8-train data=jsonl data.paths=[.../corpus.jsonl]`",
        "",
        "| package | version | licence (copyright file) | licence note | documents | text bytes | MB |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.version} | {r.licence} | {r.licence_note} | {r.docs} | {r.bytes:,} | "
            f"{r.bytes / 1e6:.2f} |"
        )
    tot_d = sum(r.docs for r in results)
    tot_b = sum(r.bytes for r in results)
    lines += [f"| total | | | | {tot_d} | {tot_b:,} | {tot_b / 1e6:.2f} |", "", "## Packages", ""]
    for r in results:
        lines += [
            f"### {r.name} {r.version}",
            "",
            f"- content: {r.what}",
            f"- .deb: `{r.deb}`, sha256 `{r.deb_sha256}`",
            f"- licence: {r.licence} per `/usr/share/doc/{r.name}/copyright` (copied to "
            f"`licenses/{r.name}.copyright`); {r.licence_note}",
        ]
        if r.helpers:
            lines.append(f"- tools used, not included: {', '.join(r.helpers)}")
        lines += [
            f"- documents: {r.seen_docs} converted ({r.seen_bytes:,} bytes), {r.docs} kept ({r.bytes:,} bytes); "
            f"left out: {r.dropped_short} too short, {r.dropped_code} mostly code, {r.dropped_dup} duplicates, "
            f"{r.dropped_cap} over the size cap",
            "",
        ]
    return "\n".join(lines)


def _fmt_table(results: Sequence[PackageResult]) -> str:
    rows = [("package", "version", "licence", "docs", "MB", "left out (short/code/dup/cap)")]
    for r in results:
        rows.append(
            (
                r.name,
                r.version,
                r.licence,
                str(r.docs),
                f"{r.bytes / 1e6:.2f}",
                f"{r.dropped_short}/{r.dropped_code}/{r.dropped_dup}/{r.dropped_cap}",
            )
        )
    rows.append(("total", "", "", str(sum(r.docs for r in results)), f"{sum(r.bytes for r in results) / 1e6:.2f}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for j, row in enumerate(rows):
        out.append("  ".join(c.rjust(w) if i in (3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0 or j == len(rows) - 2:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def build(
    out: Path,
    packages: Sequence[str],
    *,
    debs_dir: Optional[Path] = None,
    work: Optional[Path] = None,
    max_mb: Optional[Dict[str, float]] = None,
    max_code_fraction: float = DEFAULT_MAX_CODE_FRACTION,
    min_chars: int = DEFAULT_MIN_CHARS,
    xz: bool = False,
    xz_preset: int = 9,
    apt_update: bool = False,
) -> Dict[str, object]:
    """Build ``out/corpus.jsonl`` and ``out/SOURCES.md`` (and ``corpus.jsonl.xz``); returns a summary."""
    t_start = time.perf_counter()
    specs = [package_spec(p) for p in sorted(set(packages))]
    _need_tool(
        "dpkg-deb",
        "it extracts the .deb files: install dpkg (Debian/Ubuntu have it), "
        "or build the corpus on a Debian machine and copy OUT/corpus.jsonl",
    )
    wanted = sorted({s.name for s in specs} | {h for s in specs for h in s.helpers})
    out.mkdir(parents=True, exist_ok=True)
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="study_corpus_")) if own_work else work
    work.mkdir(parents=True, exist_ok=True)
    if own_work:
        work.chmod(0o755)  # apt's sandbox user must reach the download folder
    try:
        if debs_dir is not None:
            debs = find_debs(debs_dir, wanted)
            print(f"[debs] using {len(debs)} .deb files from {debs_dir}", flush=True)
        else:
            if apt_update:
                print("[download] apt-get update", flush=True)
                r = subprocess.run(["apt-get", "update"], capture_output=True, text=True)
                if r.returncode != 0:
                    raise CorpusError(f"apt-get update failed (it needs root): {r.stderr.strip()[-500:]}")
            debs = apt_download(wanted, work / "debs")
        results: List[PackageResult] = []
        all_docs: List[Tuple[str, str]] = []
        seen: set = set()
        lic_dir = out / "licenses"
        lic_dir.mkdir(exist_ok=True)
        caps = dict(DEFAULT_MAX_MB if max_mb is None else max_mb)
        for spec in specs:
            t0 = time.perf_counter()
            root = work / "root" / spec.name
            if root.exists():
                shutil.rmtree(root)
            fields = deb_fields(debs[spec.name])
            print(f"[{spec.name}] extracting {debs[spec.name].name}", flush=True)
            extract_deb(debs[spec.name], root)
            for h in spec.helpers:
                extract_deb(debs[h], root)
            copyright_file = root / f"usr/share/doc/{spec.name}/copyright"
            if not copyright_file.is_file():
                raise CorpusError(f"{spec.name}: /usr/share/doc/{spec.name}/copyright missing from the package")
            shutil.copyfile(copyright_file, lic_dir / f"{spec.name}.copyright")
            helper_versions = [f"{h} {deb_fields(debs[h]).get('Version', '?')}" for h in spec.helpers]
            result = PackageResult(
                name=spec.name,
                version=fields.get("Version", "?"),
                deb=debs[spec.name].name,
                deb_sha256=_sha256_file(debs[spec.name]),
                licence=detect_licence(decode_bytes(copyright_file.read_bytes())),
                licence_note=spec.licence_note,
                what=spec.what,
                helpers=helper_versions,
            )
            print(f"[{spec.name}] converting (version {result.version}, licence {result.licence})", flush=True)
            cap = caps.get(spec.name, caps.get("*"))
            docs = convert_package(
                spec,
                root,
                result,
                max_bytes=int(cap * 1e6) if cap else None,
                max_code_fraction=max_code_fraction,
                min_chars=min_chars,
                seen=seen,
            )
            shutil.rmtree(root, ignore_errors=True)
            result.seconds = time.perf_counter() - t0
            if not docs:
                raise CorpusError(
                    f"{spec.name}: no document kept (of {result.seen_docs} converted); "
                    "check --min-chars / --max-code-fraction"
                )
            print(
                f"[{spec.name}] {result.docs} documents, {result.bytes / 1e6:.2f} MB kept of "
                f"{result.seen_docs} / {result.seen_bytes / 1e6:.2f} MB converted ({result.seconds:.1f}s)",
                flush=True,
            )
            results.append(result)
            all_docs.extend(docs)
        jsonl = out / "corpus.jsonl"
        print(f"[write] {jsonl}", flush=True)
        n = write_jsonl(jsonl, all_docs)
        sha = _sha256_file(jsonl)
        xz_info = None
        if xz:
            xz_path = out / "corpus.jsonl.xz"
            print(f"[xz] {xz_path} (preset {xz_preset}; takes a while)", flush=True)
            t0 = time.perf_counter()
            size = write_xz(jsonl, xz_path, xz_preset)
            xz_info = (_sha256_file(xz_path), size)
            print(f"[xz] {size / 1e6:.2f} MB ({size / 2**20:.2f} MiB) in {time.perf_counter() - t0:.0f}s", flush=True)
        else:
            stale = out / "corpus.jsonl.xz"
            if stale.exists():
                stale.unlink()
        cap_opts = " ".join(f"{k}={v:g}" if k != "*" else f"{v:g}" for k, v in sorted(caps.items()))
        options = (
            f"--packages {' '.join(s.name for s in specs)} --max-mb {cap_opts} --max-code-fraction "
            f"{max_code_fraction} --min-chars {min_chars}"
        )
        (out / "SOURCES.md").write_text(sources_md(results, sha, n, options, xz_info), encoding="utf-8")
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    print()
    print(_fmt_table(results))
    print()
    print(f"corpus.jsonl     {n:,} bytes ({n / 1e6:.2f} MB)  sha256 {sha}")
    if xz_info:
        print(f"corpus.jsonl.xz  {xz_info[1]:,} bytes ({xz_info[1] / 1e6:.2f} MB)  sha256 {xz_info[0]}")
    print(
        f"built in {elapsed:.0f}s into {out}; train with: nemo-fp8-train data=jsonl data.paths=[{out / 'corpus.jsonl'}]"
    )
    return {"sha256": sha, "bytes": n, "xz": xz_info, "packages": results, "seconds": elapsed}


def _parse_cap(value: str) -> Tuple[str, float]:
    pkg, _, mb = value.rpartition("=")
    try:
        cap = float(mb)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected MB or PKG=MB, e.g. 20 or dict-gcide=15") from None
    if cap < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a cap is >= 0 (0 = no cap)")
    return (pkg or "*"), cap


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="study_corpus.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (corpus.jsonl, SOURCES.md, licenses/)")
    parser.add_argument(
        "--packages",
        nargs="+",
        default=list(DEFAULT_PACKAGES),
        metavar="PKG",
        help=f"Debian packages to use (default: {' '.join(DEFAULT_PACKAGES)}); supported: "
        f"{', '.join(supported_packages())}",
    )
    parser.add_argument(
        "--debs",
        type=Path,
        metavar="DIR",
        help="take the .deb files from DIR instead of `apt-get download` (one per package; "
        "bible-kjv-text also needs bible-kjv)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        metavar="DIR",
        help="keep downloads and extracted trees here (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "--max-mb",
        nargs="+",
        metavar="[PKG=]MB",
        type=_parse_cap,
        help="at most this many MB (1e6 bytes) of text per package, an even sample of its "
        "documents; MB alone sets every package's cap (replacing the defaults), PKG=MB one "
        "package's; 0 = no cap (default: "
        + " ".join(f"{k}={v:g}" if k != "*" else f"{v:g}" for k, v in DEFAULT_MAX_MB.items())
        + ")",
    )
    parser.add_argument(
        "--max-code-fraction",
        type=float,
        default=DEFAULT_MAX_CODE_FRACTION,
        help="drop documents whose literal blocks / <pre> make up more than this share of the "
        f"characters (default {DEFAULT_MAX_CODE_FRACTION})",
    )
    parser.add_argument(
        "--min-chars",
        type=int,
        default=DEFAULT_MIN_CHARS,
        help=f"drop documents shorter than this after conversion (default {DEFAULT_MIN_CHARS})",
    )
    parser.add_argument("--xz", action="store_true", help="also write corpus.jsonl.xz (for copying to another machine)")
    parser.add_argument(
        "--xz-preset", type=int, default=9, choices=range(10), metavar="0-9", help="xz compression preset (default 9)"
    )
    parser.add_argument("--apt-update", action="store_true", help="run `apt-get update` first (needs root)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.max_code_fraction <= 1.0:
        parser.error("--max-code-fraction must be in [0, 1]")
    caps = None
    if args.max_mb:
        caps = dict(DEFAULT_MAX_MB)
        if any(k == "*" for k, _ in args.max_mb):
            caps = {}
        caps.update(args.max_mb)
    if args.debs is not None and not args.debs.is_dir():
        parser.error(f"--debs {args.debs}: not a folder")
    try:
        for p in args.packages:
            package_spec(p)
    except CorpusError as e:
        parser.error(str(e))
    try:
        build(
            args.out,
            args.packages,
            debs_dir=args.debs,
            work=args.work,
            max_mb=caps,
            max_code_fraction=args.max_code_fraction,
            min_chars=args.min_chars,
            xz=args.xz,
            xz_preset=args.xz_preset,
            apt_update=args.apt_update,
        )
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, MissingToolError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
