"""The study corpus builder (benchmarks/study_corpus.py) on tiny synthetic inputs, on CPU, without
network or apt: the rst / HTML / gzip / dictd / fortune / Bible conversions, the licence reader,
the deterministic size cap, and a whole build from two fake .deb packages (made with
``dpkg-deb --build``) whose corpus.jsonl the trainer's JSONL loader reads."""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.benchmarks import import_benchmark


@pytest.fixture(scope="module")
def sc():
    return import_benchmark("study_corpus")


RST = """\
.. SPDX-License-Identifier: GPL-2.0

.. _intro:

=============
A Tiny Guide
=============

.. toctree::
   :maxdepth: 2

   other
   pages

The :func:`spam` function calls ``eggs()``; see :ref:`the guide <guide>` and
`Python <https://www.python.org>`_ for **more** about *it*. Read :pep:`8`.

Section two
-----------

.. note::
   Keep it short.

.. versionchanged:: 3.3
   Added the *ham* argument.

An example::

    def spam():
        return 42

.. code-block:: c

   int main(void) { return 0; }

.. function:: spam(ham=None)
              spam2()

   Return 42.

:param ham: a ham.

+------+------+
| a    | b    |
+======+======+
| c    | d    |
+------+------+

.. flat-table:: dropped
   :header-rows: 1

   * - x
     - y

.. [1] A footnote.

>>> spam()
42
"""


def test_rst_to_text(sc):
    conv = sc.rst_to_text(RST)
    t = conv.text
    assert t.startswith("A Tiny Guide\n\nThe spam function calls eggs(); see the guide and\nPython for more about it.")
    assert "Read PEP 8." in t
    for gone in (
        "SPDX",
        "toctree",
        "maxdepth",
        "other\n",
        "=====",
        "-----",
        "_intro",
        ":func:",
        "``",
        "flat-table",
        "header-rows",
        "+------+",
    ):
        assert gone not in t, gone
    assert "Section two" in t
    assert "Note: Keep it short." not in t and "Note:\nKeep it short." in t
    assert "Changed in version 3.3:\nAdded the ham argument." in t
    assert "An example:\n\ndef spam():\n    return 42" in t  # literal block kept, "::" -> ":"
    assert "int main(void) { return 0; }" in t
    assert "spam(ham=None)\nspam2()\n\nReturn 42." in t
    assert "param ham: a ham." in t
    assert "a b" in t and "c d" in t  # grid table cells kept as text
    assert "A footnote." in t
    assert ">>> spam()\n42" in t
    # the literal block, the code-block and the doctest are counted as code, the rest is prose
    assert 0.1 < conv.code_fraction < 0.5


HTML = """<!DOCTYPE html><html><head><title>Page title</title><script>var x = 1;</script>
<style>body { color: red }</style></head><body>
<div class="related" role="navigation"><ul><li><a href="genindex.html">index</a></li>
<li><a href="py-modindex.html">modules</a></li></ul></div>
<div class="document"><div class="documentwrapper"><div class="body" role="main">
<h1>Heading<a class="headerlink" href="#h">&para;</a></h1>
<p>First   paragraph with <em>emphasis</em>,
an entity &amp; a <code>literal</code>.</p>
<ul><li>one</li><li>two</li></ul>
<pre>for i in range(3):
    print(i)</pre>
<p>Last paragraph &mdash; done.</p>
</div></div>
<div class="sphinxsidebar" role="navigation"><h3>Table of Contents</h3><p>Quick search</p></div></div>
<div class="footer">&copy; Copyright 2001.</div></body></html>"""

DOCBOOK_HTML = """<html><head><title>Chapter 1</title></head><body><div id="banner"><a href="x">Download the ebook</a></div>
<ul class="docnav top"><li class="previous"><a href="a.html"><strong>Prev</strong></a></li>
<li class="home">The Handbook</li></ul><div class="chapter"><div class="titlepage"><h1 class="title">Chapter 1. Why</h1></div>
<div class="toc"><dl class="toc"><dt><span class="section"><a href="#s">1.1. Section</a></span></dt></dl></div>
<div class="para">Prose of the chapter.</div>
<div class="sidebar"><p class="title"><strong>BACK TO BASICS</strong> Aside</p><div class="para">Boxed prose.</div></div>
</div><ul class="docnav"><li class="next"><a href="b.html"><strong>Next</strong>1.2. More</a></li></ul></body></html>"""


def test_html_to_text_sphinx(sc):
    conv = sc.html_to_text(HTML)
    t = conv.text
    assert t.splitlines()[0] == "Heading"
    assert "First paragraph with emphasis,\nan entity & a literal." not in t  # whitespace is collapsed
    assert "First paragraph with emphasis, an entity & a literal." in t
    assert "- one\n- two" in t
    assert "for i in range(3):\n    print(i)" in t  # <pre> keeps its lines and indentation
    assert "Last paragraph \u2014 done." in t
    for gone in (
        "Page title",
        "var x",
        "color: red",
        "index",
        "modules",
        "\u00b6",
        "Table of Contents",
        "Quick search",
        "Copyright",
    ):
        assert gone not in t, gone
    assert conv.code_chars == len("for i in range(3):print(i)".replace(" ", ""))  # spaces not counted


def test_html_to_text_docbook(sc):
    t = sc.html_to_text(DOCBOOK_HTML).text
    assert t == "Chapter 1. Why\n\nProse of the chapter.\n\nBACK TO BASICS Aside\n\nBoxed prose."


def test_nav_pages(sc):
    for name in (
        "genindex.html",
        "genindex-A.html",
        "search.html",
        "py-modindex.html",
        "index.html",
        "ix01.html",
        "index.en.html",
    ):
        assert sc.NAV_PAGE.match(name), name
    for name in ("apt.html", "sect.apt-get.html", "indexing.html", "ch01.en.html"):
        assert not sc.NAV_PAGE.match(name), name


def test_gzip_decode_and_normalize(sc, tmp_path):
    p = tmp_path / "doc.rst.gz"
    p.write_bytes(gzip.compress("Caf\u00e9 na\u00efve\r\nline two   \r\n\r\n\r\n\r\nend\x00\n".encode("utf-8")))
    text = sc.decode_bytes(sc.read_maybe_gzip(p))
    assert sc.normalize_text(text) == "Caf\u00e9 na\u00efve\nline two\n\nend"
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"it\x92s")  # a Windows-1252 apostrophe
    assert sc.decode_bytes(sc.read_maybe_gzip(plain)) == "it\u2019s"


def test_gcide_entries(sc, tmp_path):
    entries = [
        "00-database-info\n   This file was converted from the original database.\n",
        'Abbey \\Ab"bey\\, n.\n   A monastery or nunnery.\n   [1913 Webster]\n',
        'Zebra \\Ze"bra\\, n.\n   A striped animal. [Obs.]\n   [1913 Webster +PJC]\n',
    ]
    data = "".join(entries).encode("utf-8")
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def enc(n):
        s = ""
        while True:
            s = b64[n % 64] + s
            n //= 64
            if not n:
                return s

    offs, index = 0, []
    for word, e in zip(("00-database-info", "abbey", "zebra"), entries):
        index.append(f"{word}\t{enc(offs)}\t{enc(len(e.encode()))}")
        if word == "abbey":
            index.append(f"abbeys\t{enc(offs)}\t{enc(len(e.encode()))}")  # a second headword, same entry
        offs += len(e.encode())
    d = tmp_path / "usr/share/dictd"
    d.mkdir(parents=True)
    (d / "gcide.dict.dz").write_bytes(gzip.compress(data))
    (d / "gcide.index").write_text("\n".join(sorted(index)) + "\n")
    docs = list(sc.extract_gcide(tmp_path, "dict-gcide", doc_bytes=10))
    assert [r for r, _ in docs] == ["usr/share/dictd/gcide.dict.dz#00000", "usr/share/dictd/gcide.dict.dz#00001"]
    assert docs[0][1].text == 'Abbey \\Ab"bey\\, n.\n   A monastery or nunnery.'
    assert docs[1][1].text == 'Zebra \\Ze"bra\\, n.\n   A striped animal. [Obs.]'  # usage labels stay


def test_fortunes(sc, tmp_path):
    d = tmp_path / "usr/share/games/fortunes"
    d.mkdir(parents=True)
    (d / "wisdom").write_text("A saying.\n\t-- Someone\n%\nAnother one.\n%\n")
    (d / "wisdom.dat").write_bytes(b"\x00\x00")
    (d / "art").write_text("  /\\_/\\\n ( o.o )\n%\n")
    docs = list(sc.extract_fortunes(tmp_path, "fortunes"))
    assert docs == [("usr/share/games/fortunes/wisdom", sc.Converted("A saying.\n\t-- Someone\n\nAnother one."))]


def test_bible_books(sc):
    dump = "".join(
        f"{abbr}1:1 Verse of {name}.\n{abbr}1:2 Second.\n"
        for abbr, name in zip([chr(65 + i // 26) + chr(97 + i % 26) for i in range(66)], sc.BIBLE_BOOKS)
    )
    books = sc.bible_books(dump)
    assert len(books) == 66
    assert books[0] == ("Genesis", "Genesis\n\nChapter 1\n\n1 Verse of Genesis.\n2 Second.")
    assert books[-1][0] == "Revelation"
    with pytest.raises(sc.CorpusError, match="expected 66"):
        sc.bible_books("Ge1:1 In the beginning.\n")


def test_detect_licence(sc):
    dep5 = (
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: x\n\n"
        "Files: *\nCopyright: someone\nLicense: GPL-2\n\nFiles: debian/*\nLicense: MIT\n"
    )
    assert sc.detect_licence(dep5) == "GPL-2"
    assert (
        sc.detect_licence(
            "it under the terms of the GNU General Public License as published by\nthe Free "
            "Software Foundation; either version 2, or (at your option)\nany later version."
        )
        == "GPL-2+"
    )
    assert sc.detect_licence("Its licence is GPL version 2 or later.") == "GPL-2+"
    assert sc.detect_licence("Python License\n==============\nPSF LICENSE AGREEMENT") == "PSF-2.0"
    assert sc.detect_licence("This program falls under the BSD copyright:") == "BSD"
    assert sc.detect_licence("nothing here").startswith("unknown")


def test_select_documents_cap(sc):
    docs = [(f"p:{i:03d}", "x" * 100) for i in range(50)]
    kept, dropped = sc.select_documents(docs, 1000)
    assert len(kept) == 10 and dropped == 40
    assert kept == sorted(kept)  # written in source order
    assert kept == sc.select_documents(list(docs), 1000)[0]  # deterministic
    assert {s for s, _ in kept} != {f"p:{i:03d}" for i in range(10)}  # a sample, not the first ten
    assert sc.select_documents(docs, None) == (docs, 0)


def test_unknown_package_and_missing_debs(sc, tmp_path):
    with pytest.raises(sc.CorpusError, match="not supported"):
        sc.package_spec("no-such-package")
    assert sc.package_spec("linux-doc-6.12").extract is sc.extract_linux_doc
    assert sc.package_spec("python3.13-doc").extract is sc.extract_python_doc
    if shutil.which("dpkg-deb"):
        with pytest.raises(sc.CorpusError, match="apt-get download dict-gcide"):
            sc.find_debs(tmp_path, ["dict-gcide"])


def test_missing_apt_get_says_to_use_debs(sc, monkeypatch, tmp_path):
    monkeypatch.setattr(sc.shutil, "which", lambda tool: None)
    with pytest.raises(sc.MissingToolError, match="--debs DIR"):
        sc.apt_download(["dict-gcide"], tmp_path)
    assert sc.main(["--out", str(tmp_path / "o"), "--packages", "dict-gcide"]) == 2


def _make_deb(tmp: Path, name: str, version: str, files: dict, debs: Path) -> Path:
    tree = tmp / f"tree-{name}"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: Test <test@example.org>\n"
        f"Description: fake {name}\n fake package for tests\n"
    )
    for rel, data in files.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    deb = debs / f"{name}_{version}_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)], check=True, capture_output=True
    )
    return deb


PROSE = "This paragraph is prose about the kernel, long enough to be kept as a document. " * 4


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian/Ubuntu) to build fake .deb files")
def test_build_from_fake_debs(sc, tmp_path, capsys):
    debs = tmp_path / "debs"
    debs.mkdir()
    doc = "usr/share/doc/linux-doc-9.9/Documentation"
    _make_deb(
        tmp_path,
        "linux-doc-9.9",
        "9.9.1-1",
        {
            "usr/share/doc/linux-doc-9.9/copyright": "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\nFiles: *\nLicense: GPL-2\n",
            f"{doc}/process/howto.rst.gz": gzip.compress(f"How to\n======\n\n{PROSE}\n".encode()),
            f"{doc}/a/short.rst.gz": gzip.compress(b"Short\n=====\n\n.. toctree::\n\n   x\n"),
            f"{doc}/a/code.rst.gz": gzip.compress(("Code::\n\n" + "    int x = 1;\n" * 40).encode()),
            f"{doc}/a/copy.rst.gz": gzip.compress(f"How to\n======\n\n{PROSE}\n".encode()),  # duplicate of howto
            f"{doc}/translations/it_IT/howto.rst.gz": gzip.compress(f"Come fare\n\n{PROSE}\n".encode()),
            f"{doc}/memory-barriers.txt.gz": gzip.compress(f"MEMORY BARRIERS\n\n{PROSE}\n".encode()),
        },
        debs,
    )
    book = "usr/share/doc/debian-handbook/html/en-US"
    _make_deb(
        tmp_path,
        "debian-handbook",
        "11.0",
        {
            "usr/share/doc/debian-handbook/copyright": "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
            "Files: *\nLicense: GPL-2.0+ or CC-BY-SA-3.0\n",
            f"{book}/apt.html": DOCBOOK_HTML.replace("Prose of the chapter.", PROSE),
            f"{book}/index.html": "<html><body><div class='toc'>a</div><p>" + PROSE + "</p></body></html>",
            f"{book}/ix01.html": "<html><body><p>" + PROSE + "</p></body></html>",
        },
        debs,
    )
    out = tmp_path / "out"
    res = sc.build(out, ["linux-doc-9.9", "debian-handbook"], debs_dir=debs, xz=True, xz_preset=1)
    printed = capsys.readouterr().out
    lines = (out / "corpus.jsonl").read_bytes().decode("utf-8").splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["source"] for r in recs] == [
        "debian-handbook:usr/share/doc/debian-handbook/html/en-US/apt.html",
        "linux-doc-9.9:usr/share/doc/linux-doc-9.9/Documentation/a/copy.rst.gz",  # sorted; howto is its duplicate
        "linux-doc-9.9:usr/share/doc/linux-doc-9.9/Documentation/memory-barriers.txt.gz",
    ]
    assert set(recs[0]) == {"text", "source"}
    assert recs[0]["text"].startswith("Chapter 1. Why\n\nThis paragraph is prose")
    assert recs[1]["text"] == "How to\n\n" + PROSE.strip()
    assert lzma.decompress((out / "corpus.jsonl.xz").read_bytes()) == (out / "corpus.jsonl").read_bytes()

    src = (out / "SOURCES.md").read_text()
    assert "| linux-doc-9.9 | 9.9.1-1 | GPL-2 |" in src
    assert "| debian-handbook | 11.0 | GPL-2.0+ or CC-BY-SA-3.0 |" in src
    assert res["sha256"] in src and res["sha256"] in printed
    assert "1 too short, 1 mostly code, 1 duplicates" in src
    assert (out / "licenses/linux-doc-9.9.copyright").read_text().endswith("License: GPL-2\n")
    assert "total" in printed and "corpus.jsonl.xz" in printed
    linux = next(r for r in res["packages"] if r.name == "linux-doc-9.9")
    assert (linux.docs, linux.dropped_short, linux.dropped_code, linux.dropped_dup) == (2, 1, 1, 1)

    # the same packages give the same bytes
    res2 = sc.build(tmp_path / "out2", ["debian-handbook", "linux-doc-9.9"], debs_dir=debs)
    assert res2["sha256"] == res["sha256"]
    assert not (tmp_path / "out2/corpus.jsonl.xz").exists()

    # the trainer's JSONL loader reads it: one document a record, the text in "text"
    from nemo_fp8_recipes.data import (
        DataConfig,
        iter_documents,
        list_source_files,
        load_corpus,
    )

    cfg = DataConfig(source="jsonl", paths=(str(out / "corpus.jsonl"),), cache_dir=str(tmp_path / "cache"))
    got = list(iter_documents(cfg, list_source_files(cfg)))
    assert [t.decode("utf-8") for _, t in got] == [r["text"] for r in recs]
    corpus = load_corpus(cfg)
    assert corpus.meta["train_docs"] + corpus.meta["val_docs"] == len(recs)
