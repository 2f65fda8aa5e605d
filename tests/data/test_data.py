"""Data: the stdlib corpus, user text / JSONL, the split, the token cache and the batch order."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_fp8_recipes.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    PackedTokens,
    TrainBatches,
    ValBatches,
    is_validation_doc,
    iter_documents,
    list_source_files,
    load_corpus,
)
from nemo_fp8_recipes.data import loader as loader_mod

CPU = torch.device("cpu")


def _write_docs(root: Path, n: int, size: int = 300) -> list:
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(n):
        text = f"document {i}: " + ("lorem ipsum é ∑ " * 40)[:size]
        (root / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


def test_stdlib_corpus_is_sorted_deterministic_and_stdlib_only():
    cfg = DataConfig(max_files=200)
    a, b = list_source_files(cfg), list_source_files(cfg)
    assert [f.doc_id for f in a] == [f.doc_id for f in b]
    assert [f.doc_id for f in a] == sorted(f.doc_id for f in a)
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for f in a:
        assert f.path.suffix == ".py" and root in f.path.parents
        parts = set(Path(f.doc_id).parts)
        assert not parts & {"site-packages", "dist-packages", "test", "tests"}
    assert len(a) == 200


def test_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é∑😀'\n"
    ids = tok.encode(text, eos=True)
    assert ids.dtype == np.uint16 and ids[-1] == tok.EOS and ids[:-1].max() < 256
    assert tok.decode(ids) == text + "\n"
    assert tok.vocab_size == 259


def test_cache_is_built_once_reused_and_atomic(tmp_path):
    cfg = DataConfig(max_files=30, cache_dir=str(tmp_path / "cache"))
    c1 = load_corpus(cfg)
    assert c1.meta["cache_hit"] is False
    assert isinstance(c1.train, np.memmap)
    files = sorted(p.name for p in c1.cache_path.iterdir())
    assert files == ["meta.json", "train.bin", "val.bin"]  # no temporary files left
    c2 = load_corpus(cfg)
    assert c2.meta["cache_hit"] is True and c2.fingerprint == c1.fingerprint
    assert np.array_equal(c1.train, c2.train) and np.array_equal(c1.val, c2.val)
    # every byte of every file is in exactly one split, each document followed by EOS
    docs = list(iter_documents(cfg, list_source_files(cfg)))
    assert len(c1.train) + len(c1.val) == sum(len(d) + 1 for _, d in docs)
    assert c1.meta["train_docs"] + c1.meta["val_docs"] == len(docs)


def test_cache_key_follows_the_file_list_and_contents(tmp_path):
    _write_docs(tmp_path / "corpus", 10)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "corpus"),), cache_dir=str(tmp_path / "c"))
    c1 = load_corpus(cfg)
    f = tmp_path / "corpus" / "doc_003.txt"
    f.write_text("changed and longer text " * 5, encoding="utf-8")
    c2 = load_corpus(cfg)
    assert c2.fingerprint != c1.fingerprint and c2.meta["cache_hit"] is False
    c3 = load_corpus(
        DataConfig(source="text", paths=(str(tmp_path / "corpus"),), max_files=5, cache_dir=str(tmp_path / "c"))
    )
    assert c3.fingerprint not in (c1.fingerprint, c2.fingerprint)


def test_the_token_digest_follows_the_content_not_the_file(tmp_path):
    """``Corpus.tokens_sha256`` is SHA-256 over the token streams as hashlib computes it here from
    the arrays; a cache hit gives the same; new text at the same path gives another."""
    import hashlib

    _write_docs(tmp_path / "a", 10)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "a"),), cache_dir=str(tmp_path / "c"))
    c1 = load_corpus(cfg)
    h = hashlib.sha256()
    for split, arr in (("train", c1.train), ("val", c1.val)):
        h.update(f"{split}:{len(arr)}:".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    assert c1.tokens_sha256 == h.hexdigest()
    assert load_corpus(cfg).tokens_sha256 == c1.tokens_sha256  # from the cache
    (tmp_path / "a" / "doc_003.txt").write_text("changed text " * 30, encoding="utf-8")
    assert load_corpus(cfg).tokens_sha256 != c1.tokens_sha256


def test_incomplete_cache_is_rebuilt(tmp_path):
    cfg = DataConfig(max_files=10, cache_dir=str(tmp_path / "cache"))
    c1 = load_corpus(cfg)
    expected = np.array(c1.train)
    # a torn write: the token file is short but meta.json claims more
    with open(c1.cache_path / "train.bin", "r+b") as f:
        f.truncate(100)
    c2 = load_corpus(cfg)
    assert c2.meta["cache_hit"] is False and np.array_equal(np.array(c2.train), expected)
    # a build that died before writing meta.json is never used
    (c1.cache_path / "meta.json").unlink()
    assert load_corpus(cfg).meta["cache_hit"] is False


def test_split_is_by_document_hash_and_deterministic(tmp_path):
    texts = _write_docs(tmp_path / "corpus", 60)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "corpus"),), val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    c = load_corpus(cfg)
    ids = [f.doc_id for f in list_source_files(cfg)]
    val_ids = [d for d in ids if is_validation_doc(d, 0.2)]
    assert 0 < len(val_ids) < len(ids)
    assert c.meta["val_docs"] == len(val_ids)
    val_bytes = sum(len(texts[ids.index(d)].encode()) + 1 for d in val_ids)
    assert len(c.val) == val_bytes
    # independent of the other documents: dropping files does not move a document's split
    assert all(is_validation_doc(d, 0.2) == (d in val_ids) for d in ids[:10])


def test_tiny_corpora_still_get_a_validation_split(tmp_path):
    _write_docs(tmp_path / "two", 2)
    c = load_corpus(
        DataConfig(source="text", paths=(str(tmp_path / "two"),), val_fraction=0.01, cache_dir=str(tmp_path / "c"))
    )
    assert c.meta["val_docs"] == 1 and c.meta["train_docs"] == 1
    (tmp_path / "one.txt").write_text("x" * 1000)
    c = load_corpus(
        DataConfig(source="text", paths=(str(tmp_path / "one.txt"),), val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    )
    assert c.meta["tail_split"] and len(c.val) == 100 and len(c.train) == 901


def test_jsonl_records_are_documents(tmp_path):
    path = tmp_path / "data.jsonl"
    recs = [{"text": f"record {i} " * 10, "id": i} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n", encoding="utf-8")
    cfg = DataConfig(source="jsonl", paths=(str(path),), cache_dir=str(tmp_path / "c"))
    c = load_corpus(cfg)
    assert c.meta["train_docs"] + c.meta["val_docs"] == 20
    assert len(c.train) + len(c.val) == sum(len(r["text"]) + 1 for r in recs)
    # a directory of JSONL files, with a custom field
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (tmp_path / "dir" / "ignored.txt").write_text("not jsonl")
    c = load_corpus(
        DataConfig(
            source="jsonl",
            paths=(str(tmp_path / "dir"),),
            text_key="body",
            val_fraction=0.0,
            cache_dir=str(tmp_path / "c"),
        )
    )
    assert ByteTokenizer().decode(c.train) == "hello\n"


def test_jsonl_errors_name_the_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: record has no 'text' field.*content"):
        load_corpus(DataConfig(source="jsonl", paths=(str(path),), cache_dir=str(tmp_path / "c")))
    path.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: not valid JSON"):
        load_corpus(DataConfig(source="jsonl", paths=(str(path),), cache_dir=str(tmp_path / "c")))


def test_missing_or_empty_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="data path not found: .*nowhere"):
        load_corpus(DataConfig(source="text", paths=(str(tmp_path / "nowhere"),)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no input files found"):
        load_corpus(DataConfig(source="text", paths=(str(tmp_path / "empty"),)))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="no text"):
        load_corpus(DataConfig(source="text", paths=(str(tmp_path / "blank"),), cache_dir=str(tmp_path / "c")))
    with pytest.raises(DataError, match="needs data.paths"):
        DataConfig(source="text")
    with pytest.raises(DataError, match="stdlib, text, jsonl"):
        DataConfig(source="parquet")


def test_binary_and_hidden_files_are_skipped_and_limits_apply(tmp_path):
    _write_docs(tmp_path / "c", 5)
    (tmp_path / "c" / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "c" / ".hidden.txt").write_text("secret")
    cfg = DataConfig(source="text", paths=(str(tmp_path / "c"),))
    names = [f.path.name for f in list_source_files(cfg)]
    assert names == [f"doc_{i:03d}.txt" for i in range(5)]
    assert len(list_source_files(DataConfig(source="text", paths=(str(tmp_path / "c"),), max_files=2))) == 2
    size = (tmp_path / "c" / "doc_000.txt").stat().st_size
    limited = list_source_files(DataConfig(source="text", paths=(str(tmp_path / "c"),), max_bytes=size + 1))
    assert len(limited) == 2  # whole files, stop once the budget is reached


def test_packing_windows_and_targets():
    tokens = np.arange(1000, dtype=np.uint16)
    packed = PackedTokens(tokens, seq_len=16)
    assert len(packed) == (1000 - 1) // 16
    x, y = packed.batch([0, 3], CPU)
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    assert torch.equal(x[1], torch.arange(48, 64)) and torch.equal(y[1], torch.arange(49, 65))


def test_batch_order_is_a_pure_function_of_seed_and_step():
    packed = PackedTokens(np.arange(10_000, dtype=np.uint16), seq_len=8)
    a = TrainBatches(packed, seed=1, micro_batch_size=4, grad_accum=2)
    b = TrainBatches(packed, seed=1, micro_batch_size=4, grad_accum=2)
    c = TrainBatches(packed, seed=2, micro_batch_size=4, grad_accum=2)
    # any order of access gives the same batches (no iterator state)
    later = a.indices(500, 1)
    assert b.indices(0, 0) == a.indices(0, 0) and b.indices(500, 1) == later
    assert c.indices(0, 0) != a.indices(0, 0)
    # one epoch visits every window exactly once, the next epoch is a different permutation
    n = len(packed)
    steps = n // a.samples_per_step
    seen = [i for s in range(steps) for m in range(2) for i in a.indices(s, m)]
    assert len(set(seen)) == len(seen) == steps * 8
    assert a.sample_index(n) != a.sample_index(0) or a.sample_index(n + 1) != a.sample_index(1)


def test_affine_permutation_for_huge_corpora(monkeypatch):
    monkeypatch.setattr(loader_mod, "_FULL_PERMUTATION_MAX", 10)
    packed = PackedTokens(np.arange(1001, dtype=np.uint16), seq_len=10)
    tb = TrainBatches(packed, seed=3, micro_batch_size=1, grad_accum=1)
    assert sorted(tb.sample_index(g) for g in range(len(packed))) == list(range(len(packed)))


def test_validation_set_is_fixed_and_spread():
    packed = PackedTokens(np.arange(5000, dtype=np.uint16), seq_len=10)
    v = ValBatches(packed, micro_batch_size=4, num_batches=3)
    assert len(v) == 3
    flat = [i for b in v.batches for i in b]
    assert flat[0] == 0 and flat[-1] == len(packed) - 1
    assert [b for b in v.batches] == ValBatches(packed, micro_batch_size=4, num_batches=3).batches


def test_too_little_text_for_one_sequence_is_explained():
    packed = PackedTokens(np.arange(10, dtype=np.uint16), seq_len=64, split="train")
    with pytest.raises(DataError, match="fewer than one sequence.*trainer.seq_len"):
        TrainBatches(packed, seed=0, micro_batch_size=1, grad_accum=1)
    with pytest.raises(DataError, match="val_interval=0"):
        ValBatches(PackedTokens(np.arange(10, dtype=np.uint16), 64, "validation"), micro_batch_size=1, num_batches=1)
