"""Local text corpora, a deterministic train/validation split, and a memory-mapped token cache.

Sources (``data.source``):

- ``stdlib`` (default): the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), sorted by relative path; third-party packages
  (``site-packages``/``dist-packages``) and ``test``/``tests`` directories (which some
  distributions ship separately) are left out. Real text that is on every machine with Python,
  so the trainer needs no download. The corpus is a function of the interpreter version.
- ``text``: files and/or directories in ``data.paths`` (directories are searched with
  ``data.glob``, hidden entries and binary files skipped); one file = one document.
- ``jsonl``: JSON-lines files (or directories of them); one record = one document, its text in
  the ``data.text_key`` field (default ``text``).

The split is by document: a document goes to validation when a hash of its id falls below
``data.val_fraction`` — deterministic, independent of order and of the other documents.
Documents are tokenised once (byte-level, each followed by EOS) into two flat token files,
``train.bin`` and ``val.bin``, in a cache directory keyed by a hash of the source file list
(path, size, mtime), the tokenizer and the split. Files are written to temporary names, fsynced
and renamed into place, with ``meta.json`` written last, so an interrupted build never leaves a
cache that looks valid; concurrent builders write identical bytes and the last rename wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._io import fsync_dir as _fsync_dir
from ..options import env_setting
from .tokenizer import ByteTokenizer

__all__ = [
    "DataConfig",
    "DataError",
    "SourceFile",
    "Corpus",
    "list_source_files",
    "iter_documents",
    "is_validation_doc",
    "load_corpus",
    "default_cache_dir",
    "stdlib_root",
]

log = logging.getLogger(__name__)

#: Bumped whenever the cache layout or the document rules change (2: meta.json holds ``tokens_sha256``).
CACHE_FORMAT = 2
_SOURCES = ("stdlib", "text", "jsonl")
_SKIP_DIRS_STDLIB = {"site-packages", "dist-packages", "__pycache__", "test", "tests"}


class DataError(ValueError):
    """Bad or missing training data; the message says what was looked at and how to fix it."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it is split (the Hydra ``data`` group).

    Attributes:
        name: config name (for logs).
        source: ``stdlib``, ``text`` or ``jsonl``.
        paths: files or directories (``text`` / ``jsonl``); ignored for ``stdlib``.
        glob: pattern for files inside directories (default: ``**/*`` for text,
            ``**/*.jsonl`` for jsonl when left as ``None``).
        text_key: JSONL field holding the document text.
        val_fraction: share of documents (by hash of their id) held out for validation.
        max_files: use only the first N files (sorted) — for quick runs and tests.
        max_bytes: stop adding files once this many bytes are in (whole files).
        cache_dir: token cache location; ``None`` = ``$NEMO_FP8_CACHE_DIR`` or
            ``~/.cache/nemo_fp8_recipes/tokens``.
    """

    name: str = "stdlib"
    source: str = "stdlib"
    paths: Tuple[str, ...] = ()
    glob: Optional[str] = None
    text_key: str = "text"
    val_fraction: float = 0.02
    max_files: Optional[int] = None
    max_bytes: Optional[int] = None
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.source not in _SOURCES:
            raise DataError(f"data.source={self.source!r} is not valid; choose one of: {', '.join(_SOURCES)}")
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        object.__setattr__(self, "paths", tuple(str(p) for p in (paths or ())))
        if self.source != "stdlib" and not self.paths:
            raise DataError(
                f"data.source={self.source} needs data.paths (files or directories), e.g. "
                f"`data={self.source} data.paths=[/path/to/corpus]`"
            )
        if not 0.0 <= float(self.val_fraction) < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        for k in ("max_files", "max_bytes"):
            v = getattr(self, k)
            if v is not None and int(v) <= 0:
                raise DataError(f"data.{k} must be positive or null, got {v}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "DataConfig":
        """Build from a mapping (e.g. the Hydra ``data`` node); unknown keys list the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(values) - set(valid))
        if bad:
            raise DataError(f"unknown data option(s) {bad}; valid options: {', '.join(valid)}")
        return cls(**dict(values))


@dataclass(frozen=True)
class SourceFile:
    """One input file, with the id prefix its documents get (a path relative to its root)."""

    path: Path
    doc_id: str


@dataclass
class Corpus:
    """Tokenised corpus: flat token streams (read-only memmaps) and what they were built from."""

    train: np.ndarray
    val: np.ndarray
    fingerprint: str
    meta: Dict[str, Any] = field(default_factory=dict)
    cache_path: Optional[Path] = None

    @property
    def tokens_sha256(self) -> str:
        """SHA-256 of the token streams (train, then validation): what the runs were trained and
        validated on. The cache key (:attr:`fingerprint`) follows the files' names, sizes and
        times; this follows the tokens, so two runs that read one path before and after its text
        changed are told apart (``summary.json``'s ``data_sha256``)."""
        return self.meta["tokens_sha256"]


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def default_cache_dir() -> Path:
    """``$NEMO_FP8_CACHE_DIR``, else ``$XDG_CACHE_HOME/nemo_fp8_recipes/tokens``, else
    ``~/.cache/nemo_fp8_recipes/tokens``."""
    env = env_setting("cache_dir")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nemo_fp8_recipes" / "tokens"


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" in f.read(8192)


def list_source_files(cfg: DataConfig) -> List[SourceFile]:
    """The input files of ``cfg``, in a deterministic order, after ``max_files``/``max_bytes``.

    Raises :class:`DataError` for a missing path or when nothing usable is found.
    """
    files: List[SourceFile] = []
    if cfg.source == "stdlib":
        root = stdlib_root()
        if not root.is_dir():
            raise DataError(f"the Python standard library was not found at {root}")
        found = []
        for p in root.rglob("*.py"):
            rel = p.relative_to(root)
            if _SKIP_DIRS_STDLIB & set(rel.parts[:-1]) or not p.is_file():
                continue
            found.append((rel.as_posix(), p))
        files = [SourceFile(p, rel) for rel, p in sorted(found)]
        where = f"the standard library at {root}"
    else:
        pattern = cfg.glob or ("**/*.jsonl" if cfg.source == "jsonl" else "**/*")
        skipped_binary = 0
        for entry in cfg.paths:
            p = Path(entry).expanduser()
            if not p.exists():
                raise DataError(f"data path not found: {entry} (data.paths for data.source={cfg.source})")
            if p.is_file():
                if cfg.source == "text" and _looks_binary(p):
                    raise DataError(
                        f"data path {entry} is a binary file (it holds NUL bytes), not text; give text files or "
                        "directories (binary files found inside a directory are skipped)"
                    )
                files.append(SourceFile(p.resolve(), p.name))
                continue
            root = p.resolve()
            found = []
            for q in root.glob(pattern):
                rel = q.relative_to(root)
                if not q.is_file() or _is_hidden(rel):
                    continue
                if cfg.source == "text" and _looks_binary(q):
                    skipped_binary += 1
                    continue
                found.append((rel.as_posix(), q))
            files.extend(SourceFile(q, f"{root.name}/{rel}") for rel, q in sorted(found))
        if skipped_binary:
            log.warning("skipped %d binary file(s) under %s", skipped_binary, ", ".join(cfg.paths))
        where = f"{', '.join(cfg.paths)} (glob {pattern!r})"
    if cfg.max_files is not None:
        files = files[: int(cfg.max_files)]
    if cfg.max_bytes is not None:
        kept, total = [], 0
        for f in files:
            if total >= int(cfg.max_bytes):
                break
            kept.append(f)
            total += f.path.stat().st_size
        files = kept
    if not files:
        raise DataError(f"no input files found in {where}")
    return files


def iter_documents(cfg: DataConfig, files: Sequence[SourceFile]) -> Iterator[Tuple[str, bytes]]:
    """Yield ``(doc_id, utf-8 bytes)`` for every non-empty document of ``files``."""
    for f in files:
        if cfg.source == "jsonl":
            unpaired = []  # lines whose text holds a lone UTF-16 surrogate: not Unicode text, skipped
            with open(f.path, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"{f.path}:{lineno}: not valid UTF-8 (byte {e.start} of the line: "
                            f"{line[e.start : e.start + 4]!r}); JSONL files must be UTF-8 text: re-encode it "
                            "(e.g. iconv -f latin1 -t utf-8) or drop the line"
                        ) from None
                    except json.JSONDecodeError as e:
                        raise DataError(f"{f.path}:{lineno}: not valid JSON ({e.msg})") from None
                    except RecursionError:
                        raise DataError(
                            f"{f.path}:{lineno}: JSON nested too deeply for Python's parser (a record is an object "
                            f"with a {cfg.text_key!r} string); fix or drop the line"
                        ) from None
                    if not isinstance(rec, dict) or cfg.text_key not in rec:
                        keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                        raise DataError(
                            f"{f.path}:{lineno}: record has no {cfg.text_key!r} field "
                            f"(found: {keys}); set data.text_key"
                        )
                    text = rec[cfg.text_key]
                    if not isinstance(text, str):
                        raise DataError(f"{f.path}:{lineno}: field {cfg.text_key!r} is not a string")
                    if not text:
                        continue
                    try:
                        data = text.encode("utf-8")
                    except UnicodeEncodeError:  # "\ud800": valid JSON, common in crawled text
                        unpaired.append(lineno)
                        continue
                    yield f"{f.doc_id}:{lineno}", data
            if unpaired:
                log.warning(
                    "%s: %d line(s) skipped, their %r text holds a lone UTF-16 surrogate (not Unicode text; lines %s)",
                    f.path,
                    len(unpaired),
                    cfg.text_key,
                    ", ".join(map(str, unpaired[:5])) + (", ..." if len(unpaired) > 5 else ""),
                )
        else:
            data = f.path.read_bytes()
            if data:
                yield f.doc_id, data


def _doc_hash(doc_id: str) -> float:
    h = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def is_validation_doc(doc_id: str, val_fraction: float) -> bool:
    """Whether document ``doc_id`` belongs to the validation split (hash below the fraction)."""
    return _doc_hash(doc_id) < val_fraction


def _fingerprint(cfg: DataConfig, files: Sequence[SourceFile], tokenizer: ByteTokenizer) -> str:
    listing = []
    for f in files:
        st = f.path.stat()
        listing.append([str(f.path), f.doc_id, st.st_size, st.st_mtime_ns])
    key = {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.name,
        "source": cfg.source,
        "text_key": cfg.text_key if cfg.source == "jsonl" else None,
        "val_fraction": float(cfg.val_fraction),
        "files": listing,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def _write_split(cfg, files, tokenizer, out_dir: Path, tag: str, force_val: Optional[str]) -> Dict[str, Any]:
    """Tokenise every document into ``train``/``val`` temp files; returns counts."""
    dtype = tokenizer.token_dtype()
    tmp = {s: out_dir / f".{s}.bin.{tag}" for s in ("train", "val")}
    counts = {"train_tokens": 0, "val_tokens": 0, "train_docs": 0, "val_docs": 0}
    min_doc: Optional[Tuple[float, str]] = None
    with open(tmp["train"], "wb") as ft, open(tmp["val"], "wb") as fv:
        for doc_id, data in iter_documents(cfg, files):
            h = _doc_hash(doc_id)
            if min_doc is None or h < min_doc[0]:
                min_doc = (h, doc_id)
            val = (doc_id == force_val) if force_val is not None else h < cfg.val_fraction
            ids = tokenizer.encode(data, eos=True)
            ids.astype(dtype, copy=False).tofile(fv if val else ft)
            split = "val" if val else "train"
            counts[f"{split}_tokens"] += int(ids.size)
            counts[f"{split}_docs"] += 1
        for fh in (ft, fv):
            fh.flush()
            os.fsync(fh.fileno())
    counts["min_hash_doc"] = min_doc[1] if min_doc else None
    counts["_tmp"] = tmp
    return counts


def _build_cache(cfg: DataConfig, files, tokenizer, out_dir: Path, fingerprint: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        _build_cache_files(cfg, files, tokenizer, out_dir, fingerprint, tag)
    except BaseException:
        # a data error (bad JSON, bad UTF-8, ...) or an interruption: leave no temporary files
        for p in out_dir.glob(f".*.{tag}"):
            p.unlink(missing_ok=True)
        raise


def _build_cache_files(cfg: DataConfig, files, tokenizer, out_dir: Path, fingerprint: str, tag: str) -> None:
    t0 = time.perf_counter()
    counts = _write_split(cfg, files, tokenizer, out_dir, tag, None)
    docs = counts["train_docs"] + counts["val_docs"]
    if docs == 0:
        for p in counts["_tmp"].values():
            p.unlink(missing_ok=True)
        raise DataError(f"no text in the {len(files)} input file(s) (every document is empty)")
    tail_split = False
    if cfg.val_fraction > 0 and counts["val_docs"] == 0:
        if docs >= 2:
            # Too few documents for the hash to pick one: hold out the one with the lowest hash
            # (the first the hash rule would pick as val_fraction grows). Deterministic.
            for p in counts["_tmp"].values():
                p.unlink(missing_ok=True)
            counts = _write_split(cfg, files, tokenizer, out_dir, tag, counts["min_hash_doc"])
        else:
            tail_split = True
    tmp = counts.pop("_tmp")
    counts.pop("min_hash_doc", None)
    if tail_split:
        # A single document: hold out its tail (the only split a one-document corpus allows).
        dtype = tokenizer.token_dtype()
        tokens = np.fromfile(tmp["train"], dtype=dtype)
        n_val = max(1, int(round(len(tokens) * cfg.val_fraction)))
        for path, part in ((tmp["train"], tokens[:-n_val]), (tmp["val"], tokens[-n_val:])):
            with open(path, "wb") as fh:
                part.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())
        counts.update(train_tokens=len(tokens) - n_val, val_tokens=n_val, val_docs=0)
    for split in ("train", "val"):
        os.replace(tmp[split], out_dir / f"{split}.bin")
    digest = hashlib.sha256()
    for split in ("train", "val"):
        digest.update(f"{split}:{counts[f'{split}_tokens']}:".encode())
        with open(out_dir / f"{split}.bin", "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    meta = {
        "fingerprint": fingerprint,
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.name,
        "dtype": tokenizer.token_dtype().name,
        "source": cfg.source,
        "num_files": len(files),
        "first_file": str(files[0].path),
        "last_file": str(files[-1].path),
        "val_fraction": float(cfg.val_fraction),
        "tail_split": tail_split,
        "tokens_sha256": digest.hexdigest(),
        **counts,
    }
    meta_tmp = out_dir / f".meta.json.{tag}"
    with open(meta_tmp, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(meta_tmp, out_dir / "meta.json")
    _fsync_dir(out_dir)
    log.info(
        "tokenised %d files (%d train / %d val docs, %d / %d tokens) in %.1fs into %s",
        len(files),
        meta["train_docs"],
        meta["val_docs"],
        meta["train_tokens"],
        meta["val_tokens"],
        time.perf_counter() - t0,
        out_dir,
    )


def _read_cache(out_dir: Path, fingerprint: str) -> Optional[Dict[str, Any]]:
    meta_path = out_dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != fingerprint:
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        p = out_dir / f"{split}.bin"
        if not p.is_file() or p.stat().st_size != meta[f"{split}_tokens"] * itemsize:
            return None
    return meta


def _memmap(path: Path, dtype: str, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def load_corpus(cfg: DataConfig, tokenizer: Optional[ByteTokenizer] = None) -> Corpus:
    """Tokenised corpus for ``cfg``: from the cache when its key matches, else built (atomically).

    Raises :class:`DataError` with what was looked at when there is no usable text.
    """
    tokenizer = tokenizer or ByteTokenizer()
    files = list_source_files(cfg)
    fingerprint = _fingerprint(cfg, files, tokenizer)
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    out_dir = root / fingerprint[:20]
    meta = _read_cache(out_dir, fingerprint)
    if meta is None:
        _build_cache(cfg, files, tokenizer, out_dir, fingerprint)
        meta = _read_cache(out_dir, fingerprint)
        if meta is None:  # pragma: no cover - only if the directory is being deleted under us
            raise DataError(f"token cache at {out_dir} could not be read back after writing it")
        meta["cache_hit"] = False
    else:
        meta["cache_hit"] = True
        log.info("token cache hit: %s", out_dir)
    train = _memmap(out_dir / "train.bin", meta["dtype"], meta["train_tokens"])
    val = _memmap(out_dir / "val.bin", meta["dtype"], meta["val_tokens"])
    return Corpus(train=train, val=val, fingerprint=fingerprint, meta=meta, cache_path=out_dir)
