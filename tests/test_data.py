"""Corpus lookup, download and verification, reading errors, length filter, batching, collate."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import http.server
import random
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import pytest
import torch

from nmtcore import data
from nmtcore.config import DataConfig
from nmtcore.data import (
    CORPORA,
    DataError,
    EncodedSplit,
    batch_indices,
    collate,
    corpus,
    corpus_file,
    encode_split,
    inference_batches,
    iterate_batches,
    length_filter,
    load_split,
    prepare_data,
    read_lines,
    restore_order,
)
from nmtcore.data import vocab as tokenization

IDS = SimpleNamespace(pad_id=0, unk_id=1, bos_id=2, eos_id=3)  # what collate needs from a vocab

WORDS = {"en": "a dog runs in the park with two young men near bushes".split(),
         "de": "ein Hund läuft in dem Park mit zwei jungen Männern nahe Büschen".split()}


def write(path: Path, lines: list[str] | bytes, gz: bool = False) -> Path:
    blob = lines if isinstance(lines, bytes) else "".join(ln + "\n" for ln in lines).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(blob) if gz else blob)
    return path


def parallel_dir(root: Path, n: int = 120, splits: tuple[str, ...] = ("train", "val", "test"),
                 gz: bool = False) -> Path:
    """A small en-de 'parallel' corpus: word i of en translates to word i of de."""
    rng = random.Random(0)
    for split in splits:
        idx = [[rng.randrange(len(WORDS["en"])) for _ in range(rng.randint(1, 9))] for _ in range(n)]
        for lang in ("en", "de"):
            write(root / f"{split}.{lang}{'.gz' if gz else ''}", [" ".join(WORDS[lang][i] for i in s) for s in idx],
                  gz=gz)
    return root


def cfg_for(data_dir: Path | str, cache: Path, **kw: object) -> DataConfig:
    base = dict(corpus="parallel", data_dir=str(data_dir), cache_dir=str(cache), src_lang="en", tgt_lang="de",
                valid_split="val", test_splits=("test",), vocab_size=40, download=False)
    base.update(kw)
    return DataConfig(**base)


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.exists() else []


# ------------------------------------------------------------------------------------------------ reading
def test_read_lines_normalises_whitespace(tmp_path: Path) -> None:
    p = write(tmp_path / "x.en", "\ufeff  Two  dogs\t run.\r\nA\u00a0cat \n\n last line".encode("utf-8"))
    assert read_lines(p) == ["Two dogs run.", "A cat", "", "last line"]
    g = write(tmp_path / "x.de", ["a  b", "c"], gz=True)
    g = g.rename(tmp_path / "x.de.gz")
    assert read_lines(g) == ["a b", "c"]
    # Only \n separates lines: a form feed or U+2028 inside a line does not make an extra line.
    p2 = write(tmp_path / "y.en", "a\u2028b\x0cc\nd\n".encode("utf-8"))
    assert len(read_lines(p2)) == 2


def test_load_parallel_plain_and_gz(tmp_path: Path) -> None:
    for gz in (False, True):
        d = parallel_dir(tmp_path / f"gz{gz}", n=10, gz=gz)
        pt = load_split(cfg_for(d, tmp_path / "cache"), "train")
        assert len(pt.src) == len(pt.tgt) == 10 and pt.src_path.name.startswith("train.en")
        assert pt.tgt_path.name.endswith(".gz") == gz


def test_missing_files_names_both_paths_and_fix(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(DataError) as e:
        load_split(cfg_for(d, tmp_path / "cache"), "train")
    msg = str(e.value)
    assert str(d / "train.en") in msg and str(d / "train.de") in msg
    assert "--data-dir" in msg and "NMTCORE_DATA" in msg and "\n" not in msg


def test_directory_corpus_without_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NMTCORE_DATA", raising=False)
    with pytest.raises(DataError, match="data.data_dir, which is not set.*--data-dir.*NMTCORE_DATA"):
        load_split(cfg_for("", tmp_path / "cache"), "train")


def test_iwslt14_missing_says_bring_your_own(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, tmp_path / "cache", corpus="iwslt14", src_lang="de", tgt_lang="en")
    with pytest.raises(DataError, match="ships no IWSLT'14 training data.*prepare-iwslt14.sh") as e:
        load_split(cfg, "train")
    assert str(tmp_path / "train.de") in str(e.value)
    with pytest.raises(DataError, match=r"no language 'fr' \(valid: de, en\)"):
        load_split(cfg_for(tmp_path, tmp_path, corpus="iwslt14", src_lang="de", tgt_lang="fr"), "train")


def test_unknown_corpus_split_language(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"unknown corpus 'wmt99' \(registered: docparallel, iwslt14, maruf2019_devtest, "
                       r"maruf2019_europarl, maruf2019_news, maruf2019_ted, multi30k, parallel\)"):
        load_split(cfg_for(tmp_path, tmp_path, corpus="wmt99"), "train")
    m30k = cfg_for(tmp_path, tmp_path, corpus="multi30k")
    with pytest.raises(DataError, match=r"no split 'valid' \(valid: train, val, test_2016_flickr, test_2017_flickr\)"):
        load_split(m30k, "valid")
    with pytest.raises(DataError, match=r"no language 'cs' \(valid: en, de, fr\)"):
        load_split(dataclasses.replace(m30k, tgt_lang="cs"), "train")
    # prepare_data checks every split before reading (or writing) anything.
    with pytest.raises(DataError, match="no split 'test2016'"):
        prepare_data(dataclasses.replace(m30k, test_splits=("test2016",)))
    assert files_under(tmp_path) == []


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path: Path) -> None:
    write(tmp_path / "train.en", ["a"] * 5)
    write(tmp_path / "train.de", ["b"] * 4, gz=True).rename(tmp_path / "train.de.gz")
    with pytest.raises(DataError) as e:
        load_split(cfg_for(tmp_path, tmp_path / "cache"), "train")
    msg = str(e.value)
    assert f"{tmp_path / 'train.en'} has 5 lines" in msg and f"{tmp_path / 'train.de.gz'} has 4" in msg


def test_empty_file(tmp_path: Path) -> None:
    write(tmp_path / "train.en", b"")
    write(tmp_path / "train.de", b"")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'train.en'} is empty")):
        load_split(cfg_for(tmp_path, tmp_path / "cache"), "train")


@pytest.mark.parametrize("gz", [False, True])
def test_undecodable_bytes_name_file_and_line(tmp_path: Path, gz: bool) -> None:
    suffix = ".gz" if gz else ""
    write(tmp_path / f"train.en{suffix}", "ok\nstill ok\nbad \xff byte\n".encode("latin-1"), gz=gz)
    write(tmp_path / "train.de", ["a", "b", "c"])
    expected = re.escape(f"{tmp_path / ('train.en' + suffix)}: line 3 is not valid UTF-8 (byte 0xff)")
    with pytest.raises(DataError, match=expected):
        load_split(cfg_for(tmp_path, tmp_path / "cache"), "train")


def test_plain_and_gz_both_present_is_ambiguous(tmp_path: Path) -> None:
    parallel_dir(tmp_path, n=3, splits=("train",))
    write(tmp_path / "train.en.gz", ["x"] * 3, gz=True)
    with pytest.raises(DataError, match="both .*train.en and .*train.en.gz exist"):
        load_split(cfg_for(tmp_path, tmp_path / "cache"), "train")


def test_not_gzip(tmp_path: Path) -> None:
    write(tmp_path / "train.en.gz", b"plain text, not gzip\n")
    write(tmp_path / "train.de", ["a"])
    with pytest.raises(DataError, match="train.en.gz is not a valid gzip file"):
        load_split(cfg_for(tmp_path, tmp_path / "cache"), "train")


def test_failed_prepare_leaves_no_cache(tmp_path: Path) -> None:
    d = parallel_dir(tmp_path / "d", n=30)
    write(d / "test.de", ["only one line"])  # the error is in the *last* split read
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="line counts differ"):
        prepare_data(cfg_for(d, cache))
    assert files_under(cache) == []


def test_failed_vocab_training_leaves_no_vocab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = parallel_dir(tmp_path / "d", n=30)
    cache = tmp_path / "cache"

    def die(texts: object, vocab_size: int, model_prefix: Path) -> None:
        Path(f"{model_prefix}.model").write_bytes(b"partial")
        raise RuntimeError("killed")

    monkeypatch.setattr(tokenization, "_train", die)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_data(cfg_for(d, cache))
    assert list((cache / "vocab").iterdir()) == []
    assert all(not p.name.startswith(".tmp") for p in (cache / "text").iterdir())


# --------------------------------------------------------------------------------- multi30k + download
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A local HTTP server on 127.0.0.1 serving a temp dir; NMTCORE_MULTI30K_URL points at it."""
    root = tmp_path / "served"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("NMTCORE_MULTI30K_URL", f"http://127.0.0.1:{server.server_address[1]}/task1/raw/")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    try:
        yield root / "task1" / "raw"
    finally:
        server.shutdown()
        server.server_close()


def fake_multi30k(root: Path, monkeypatch: pytest.MonkeyPatch, n: int = 5) -> dict[str, str]:
    """Write small stand-ins for the Multi30k files and register their checksums."""
    sums = {}
    for split in ("train", "val"):
        for lang in ("en", "de"):
            p = write(root / f"{split}.{lang}.gz", [f"{split} {lang} {i}" for i in range(n)], gz=True)
            sums[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    monkeypatch.setitem(CORPORA, "multi30k", dataclasses.replace(CORPORA["multi30k"], sha256=sums))
    return sums


def test_download_verify_and_cache(tmp_path: Path, http_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sums = fake_multi30k(http_root, monkeypatch)
    cache = tmp_path / "cache"
    cfg = DataConfig(corpus="multi30k", cache_dir=str(cache), data_dir="", download=True)
    monkeypatch.delenv("NMTCORE_DATA", raising=False)
    pt = load_split(cfg, "train")
    assert pt.src == [f"train en {i}" for i in range(5)] and pt.tgt[0] == "train de 0"
    assert pt.src_path == cache / "data" / "multi30k" / "train.en.gz"
    assert sorted(p.name for p in files_under(cache)) == ["train.de.gz", "train.en.gz"]
    # Second time: served from the cache, no network needed.
    monkeypatch.setenv("NMTCORE_MULTI30K_URL", "http://127.0.0.1:9/nothing-here")
    assert load_split(cfg, "train").src == pt.src
    assert hashlib.sha256(pt.src_path.read_bytes()).hexdigest() == sums["train.en.gz"]


def test_corrupt_download_rejected_and_nothing_cached(tmp_path: Path, http_root: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sums = fake_multi30k(http_root, monkeypatch)
    write(http_root / "val.de.gz", ["tampered"], gz=True)
    actual = hashlib.sha256((http_root / "val.de.gz").read_bytes()).hexdigest()
    cache = tmp_path / "cache"
    cfg = DataConfig(corpus="multi30k", cache_dir=str(cache), download=True, data_dir=str(tmp_path / "none"))
    with pytest.raises(DataError) as e:
        corpus_file(cfg, "val", "de")
    msg = str(e.value)
    assert f"expected sha256 {sums['val.de.gz']}, got {actual}" in msg and "\n" not in msg
    assert files_under(cache) == []


def test_download_http_error(tmp_path: Path, http_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_multi30k(http_root, monkeypatch)
    cfg = DataConfig(corpus="multi30k", cache_dir=str(tmp_path / "cache"), download=True, data_dir="")
    monkeypatch.delenv("NMTCORE_DATA", raising=False)
    url = r"http://127\.0\.0\.1:\d+/task1/raw/test_2016_flickr\.en\.gz"
    with pytest.raises(DataError, match=rf"download of {url} failed: HTTP 404"):
        corpus_file(cfg, "test_2016_flickr", "en")
    assert files_under(tmp_path / "cache") == []


def test_corrupt_cached_file_is_refetched(tmp_path: Path, http_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sums = fake_multi30k(http_root, monkeypatch)
    cached = write(tmp_path / "cache" / "data" / "multi30k" / "train.en.gz", ["garbage"], gz=True)
    cfg = DataConfig(corpus="multi30k", cache_dir=str(tmp_path / "cache"), download=True, data_dir="")
    monkeypatch.delenv("NMTCORE_DATA", raising=False)
    assert corpus_file(cfg, "train", "en") == cached
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == sums["train.en.gz"]


def test_multi30k_no_download_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DataConfig(corpus="multi30k", cache_dir=str(tmp_path / "cache"), download=False,
                     data_dir=str(tmp_path / "data"))
    with pytest.raises(DataError) as e:
        load_split(cfg, "val")
    msg = str(e.value)
    for p in (tmp_path / "data" / "multi30k" / "val.en.gz", tmp_path / "cache" / "data" / "multi30k" / "val.de.gz"):
        assert str(p) in msg
    assert "data.download=true" in msg and "--data-dir" in msg


def test_data_dir_file_with_wrong_checksum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "data" / "multi30k"
    fake_multi30k(d, monkeypatch)
    write(d / "train.de.gz", ["edited"], gz=True)
    cfg = DataConfig(corpus="multi30k", cache_dir=str(tmp_path / "cache"), download=False,
                     data_dir=str(tmp_path / "data"))
    assert corpus_file(cfg, "train", "en") == d / "train.en.gz"
    expected = re.escape(f"checksum mismatch for {d / 'train.de.gz'}: expected sha256 ") + "[0-9a-f]{64}, got"
    with pytest.raises(DataError, match=expected):
        corpus_file(cfg, "train", "de")


def test_embedded_multi30k_checksums_match_shared_copy(shared_data: Path) -> None:
    d = shared_data / "multi30k"
    for name, expected in corpus.MULTI30K_SHA256.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == expected, name
    assert len(corpus.MULTI30K_SHA256) == 12


# ------------------------------------------------------------------------------------------- filtering
def test_length_filter_moses_semantics() -> None:
    src = np.array([1, 0, 3, 10, 2, 5, 6, 9, 1])
    tgt = np.array([1, 2, 3, 1, 19, 5, 6, 1, 9])
    kept, dropped = length_filter(src, tgt, min_len=1, max_len=6, max_len_ratio=9.0)
    # 1: src shorter than min_len; 3, 4, 7, 8: a side longer than max_len
    assert kept.tolist() == [0, 2, 5, 6] and dropped == 5
    kept, dropped = length_filter(src, tgt, min_len=1, max_len=100, max_len_ratio=9.0)
    # 3: ratio 10 and 4: ratio 9.5 are > 9; 7 and 8 have ratio exactly 9, which is kept
    assert kept.tolist() == [0, 2, 5, 6, 7, 8] and dropped == 3
    kept, dropped = length_filter(src, tgt, min_len=1, max_len=100, max_len_ratio=2.0)
    assert kept.tolist() == [0, 2, 5, 6] and dropped == 5  # 10/1, 19/2, 9/1, 9/1 > 2; 0 fails min_len
    kept, _ = length_filter(np.array([0, 0, 4]), np.array([0, 3, 4]), min_len=0, max_len=10, max_len_ratio=3.0)
    assert kept.tolist() == [0, 2]  # empty vs empty: ratio 1; empty vs 3: infinite ratio


def test_prepare_data_small_parallel(tmp_path: Path) -> None:
    d = parallel_dir(tmp_path / "d", n=150)
    write(d / "train.en", read_lines(d / "train.en")[:-1] + ["a " * 40])  # one pair over max_len
    cache = tmp_path / "cache"
    cfg = cfg_for(d, cache, max_len=30)
    prep = prepare_data(cfg)
    assert set(prep.splits) == {"train", "val", "test"}
    assert prep.train_dropped >= 1 and len(prep.train) == 150 - prep.train_dropped
    assert prep.train.src_lens.max() <= 30 and prep.train.tgt_lens.max() <= 30
    assert len(prep.valid) == 150 and len(prep.tests["test"]) == 150  # never filtered
    assert set(prep.checksums) == {f"{s}.{lang}" for s in ("train", "val", "test") for lang in ("en", "de")} | {"vocab"}
    assert prep.checksums["vocab"] == prep.vocab.checksum and len(prep.vocab) == 40
    for i in range(len(prep.valid)):  # ids decode back to the raw text
        assert prep.vocab.decode(prep.valid.tgt[i]) == prep.valid.raw_tgt[i]
    # Second run: the same text and vocab from the cache, nothing new written.
    before = {p: p.stat().st_mtime_ns for p in files_under(cache)}
    again = prepare_data(cfg)
    assert again.checksums == prep.checksums
    assert {p: p.stat().st_mtime_ns for p in files_under(cache)} == before
    assert [p.name for p in files_under(cache / "text")] == ["train.de", "train.en"]


def test_vocab_too_large_is_a_data_error(tmp_path: Path) -> None:
    d = parallel_dir(tmp_path / "d", n=40)
    with pytest.raises(DataError, match="vocab_size=5000 is too large.*lower data.vocab_size"):
        prepare_data(cfg_for(d, tmp_path / "cache", vocab_size=5000))
    assert list((tmp_path / "cache" / "vocab").iterdir()) == []


def test_filter_removing_everything_is_an_error(tmp_path: Path) -> None:
    d = parallel_dir(tmp_path / "d", n=40)
    with pytest.raises(DataError, match="removed all 40 training pairs"):
        prepare_data(cfg_for(d, tmp_path / "cache", min_len=100, max_len=200))


# -------------------------------------------------------------------------------------------- batching
def random_split(n: int, seed: int = 0, max_len: int = 60) -> EncodedSplit:
    rng = np.random.default_rng(seed)
    src_lens = rng.integers(0, max_len, n)
    tgt_lens = np.clip(src_lens + rng.integers(-5, 6, n), 0, None)
    src = [rng.integers(4, 100, k).astype(np.int32) for k in src_lens]
    tgt = [rng.integers(4, 100, k).astype(np.int32) for k in tgt_lens]
    return EncodedSplit("train", src, tgt, [""] * n, [""] * n)


def check_cover(batches: list[np.ndarray], n: int) -> None:
    flat = np.concatenate(batches)
    assert len(flat) == n and np.array_equal(np.sort(flat), np.arange(n))


@pytest.mark.parametrize("max_tokens,max_sentences", [(1000, 0), (300, 7), (64, 0), (50, 0)])
def test_batches_respect_budget_and_cover_once(max_tokens: int, max_sentences: int) -> None:
    sp = random_split(2000)
    batches = batch_indices(sp.src_lens, sp.tgt_lens, max_tokens, max_sentences, seed=3, epoch=2)
    check_cover(batches, len(sp))
    cost = np.maximum(sp.src_lens, sp.tgt_lens) + 1
    for b in batches:
        assert len(b) >= 1
        if max_sentences:
            assert len(b) <= max_sentences
        if len(b) > 1:  # a sentence over budget on its own is the only allowed excess
            assert cost[b].max() * len(b) <= max_tokens
    if max_tokens >= 300 and not max_sentences:  # the greedy packing is tight
        assert np.mean([cost[b].max() * len(b) for b in batches]) > 0.8 * max_tokens


def test_over_long_sentence_gets_own_batch() -> None:
    src_lens = np.array([3, 200, 4, 5])
    batches = batch_indices(src_lens, src_lens, max_tokens=50, shuffle=False)
    assert [b.tolist() for b in batches] == [[0, 2, 3], [1]]


def test_batches_deterministic_per_seed_epoch() -> None:
    sp = random_split(3000)
    args = (sp.src_lens, sp.tgt_lens, 800)
    a = batch_indices(*args, seed=1, epoch=1)
    b = batch_indices(*args, seed=1, epoch=1)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    c = batch_indices(*args, seed=1, epoch=2)
    d = batch_indices(*args, seed=2, epoch=1)
    for other in (c, d):
        check_cover(other, len(sp))
        assert [x.tolist() for x in other] != [x.tolist() for x in a]
    # the tie-break is random too, not only the batch order
    assert {tuple(sorted(x.tolist())) for x in a} != {tuple(sorted(x.tolist())) for x in c}


def test_no_shuffle_sorted_by_length() -> None:
    sp = random_split(500)
    batches = batch_indices(sp.src_lens, sp.tgt_lens, 500, shuffle=False)
    cost = np.maximum(sp.src_lens, sp.tgt_lens) + 1
    flat = np.concatenate(batches)
    assert np.all(np.diff(cost[flat]) >= 0)
    assert [b.tolist() for b in batches] == [b.tolist() for b in batch_indices(sp.src_lens, sp.tgt_lens, 500,
                                                                                 shuffle=False, epoch=7)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ddp_shards(world_size: int) -> None:
    sp = random_split(1000)
    full = batch_indices(sp.src_lens, sp.tgt_lens, 700, seed=5, epoch=3)
    shards = [batch_indices(sp.src_lens, sp.tgt_lens, 700, seed=5, epoch=3, rank=r, world_size=world_size)
              for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1  # every rank steps the same number of times
    n_pad = len(shards[0]) * world_size - len(full)
    assert 0 <= n_pad < world_size
    # round-robin over the single-process list, padded by repeating its first batches
    padded = full + full[:n_pad]
    for r, shard in enumerate(shards):
        assert [b.tolist() for b in shard] == [b.tolist() for b in padded[r::world_size]]
    # every sentence is seen once, except those of the padding batches, seen twice: so without
    # padding the shards are disjoint
    counts = np.bincount(np.concatenate([b for s in shards for b in s]), minlength=len(sp))
    expected = np.ones(len(sp), dtype=np.int64)
    for b in full[:n_pad]:
        expected[b] += 1
    assert np.array_equal(counts, expected)


def test_ddp_fewer_batches_than_ranks() -> None:
    lens = np.array([2, 3])
    shards = [batch_indices(lens, lens, 1000, rank=r, world_size=4) for r in range(4)]
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="rank"):
        batch_indices(lens, lens, 1000, rank=4, world_size=4)


def test_batching_is_fast() -> None:
    sp = random_split(29000, max_len=40)
    batch_indices(sp.src_lens, sp.tgt_lens, 4096)  # warm-up
    t0 = time.perf_counter()
    batches = batch_indices(sp.src_lens, sp.tgt_lens, 4096)
    elapsed = time.perf_counter() - t0
    check_cover(batches, 29000)
    assert elapsed < 0.1, f"batch_indices took {elapsed * 1e3:.0f} ms for 29k sentences"


def test_collate_layout() -> None:
    src = [np.array([10, 11, 12], np.int32), np.array([20], np.int32), np.array([], np.int32)]
    tgt = [np.array([30], np.int32), np.array([40, 41, 42, 43], np.int32), np.array([50, 51], np.int32)]
    sp = EncodedSplit("t", src, tgt, ["a", "b", "c"], ["d", "e", "f"])
    b = collate(sp, [1, 0, 2], pad_id=0, bos_id=2, eos_id=3)
    assert b.size == 3 and b.ids.tolist() == [1, 0, 2] and b.ids.dtype == torch.int64
    assert b.src.dtype == torch.int64 and b.src_mask.dtype == torch.bool
    assert b.src.tolist() == [[20, 3, 0, 0], [10, 11, 12, 3], [3, 0, 0, 0]]
    assert b.src_mask.tolist() == [[False, False, True, True], [False] * 4, [False, True, True, True]]
    assert b.tgt_in.tolist() == [[2, 40, 41, 42, 43], [2, 30, 0, 0, 0], [2, 50, 51, 0, 0]]
    assert b.tgt_out.tolist() == [[40, 41, 42, 43, 3], [30, 3, 0, 0, 0], [50, 51, 3, 0, 0]]
    assert b.tgt_mask.tolist() == [[False] * 5, [False, False, True, True, True], [False, False, False, True, True]]
    assert b.n_tgt_tokens == 5 + 2 + 3 == int((b.tgt_out != 0).sum())
    moved = b.to("cpu")
    assert torch.equal(moved.tgt_out, b.tgt_out) and moved.n_tgt_tokens == b.n_tgt_tokens
    with pytest.raises(ValueError, match="non-empty"):
        collate(sp, [], 0, 2, 3)


def test_collate_matches_slow_reference() -> None:
    sp = random_split(300)
    for idx in batch_indices(sp.src_lens, sp.tgt_lens, 600):
        b = collate(sp, idx, 0, 2, 3)
        for row, i in enumerate(idx):
            s, t = sp.src[i].tolist(), sp.tgt[i].tolist()
            S, T = b.src.shape[1], b.tgt_in.shape[1]
            assert b.src[row].tolist() == s + [3] + [0] * (S - len(s) - 1)
            assert b.tgt_in[row].tolist() == [2] + t + [0] * (T - len(t) - 1)
            assert b.tgt_out[row].tolist() == t + [3] + [0] * (T - len(t) - 1)
            assert int((~b.src_mask[row]).sum()) == len(s) + 1 and int((~b.tgt_mask[row]).sum()) == len(t) + 1


def test_iterate_batches_and_inference_order() -> None:
    sp = random_split(400)
    seen = [b.ids for b in iterate_batches(sp, IDS, max_tokens=900, seed=4, epoch=1)]
    check_cover([s.numpy() for s in seen], len(sp))
    batches = list(inference_batches(sp, IDS, max_sentences=32, max_tokens=600))
    assert all(b.size <= 32 and b.src.numel() <= 600 for b in batches)
    assert batches[0].src.shape[1] >= batches[-1].src.shape[1]  # longest first
    check_cover([b.ids.numpy() for b in batches], len(sp))
    # a fake "translation": the first source token of each row, put back in split order
    outs = restore_order(((b.ids, b.src[:, 0].tolist()) for b in batches), len(sp))
    assert outs == [int(s[0]) if len(s) else 3 for s in sp.src]
    with pytest.raises(ValueError, match="no result for"):
        restore_order([(batches[0].ids, [0] * batches[0].size)], len(sp))


def test_encode_split_without_target(tmp_path: Path) -> None:
    d = parallel_dir(tmp_path / "d", n=60, splits=("train",))
    files = [d / "train.en", d / "train.de"]
    vocab = tokenization.SubwordVocab.train_or_load(files, 40, tmp_path / "cache")
    sp = encode_split(vocab, "input", ["a dog runs", "two young men"])
    assert sp.tgt_lens.tolist() == [0, 0]
    b = next(inference_batches(sp, vocab, max_sentences=8))
    assert b.tgt_out.tolist() == [[3], [3]] and vocab.decode(b.src[0]) in ("a dog runs", "two young men")


# ------------------------------------------------------------------------------------------- real data
@pytest.fixture(scope="module")
def multi30k(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> data.PreparedData:
    cfg = DataConfig(corpus="multi30k", data_dir=str(shared_data), download=False, vocab_size=8000,
                     cache_dir=str(tmp_path_factory.mktemp("m30k_cache")),
                     test_splits=("test_2016_flickr", "test_2017_flickr"))
    return prepare_data(cfg)


def test_multi30k_real(multi30k: data.PreparedData) -> None:
    m = multi30k
    assert len(m.train) + m.train_dropped == 29000 and m.train_dropped < 50
    assert len(m.valid) == 1014 and len(m.tests["test_2016_flickr"]) == 1000
    assert len(m.tests["test_2017_flickr"]) == 1000
    assert len(m.vocab) == 8000
    assert m.checksums["train.en"] == corpus.MULTI30K_SHA256["train.en.gz"]
    assert m.valid.raw_src[0].startswith("A group of men")
    # every line without unseen characters round-trips exactly
    for sp in m.splits.values():
        for ids, raw in zip(sp.tgt, sp.raw_tgt):
            if m.vocab.unk_id not in ids:
                assert m.vocab.decode(ids) == raw
    n_unk = sum(m.vocab.unk_id in ids for ids in m.train.src + m.train.tgt)
    assert n_unk == 0  # character_coverage=1.0: no unk on the training text itself


def test_multi30k_batching(multi30k: data.PreparedData) -> None:
    tr = multi30k.train
    t0 = time.perf_counter()
    batches = batch_indices(tr.src_lens, tr.tgt_lens, 4096, seed=1, epoch=1)
    elapsed = time.perf_counter() - t0
    check_cover(batches, len(tr))
    assert elapsed < 0.1
    b = collate(tr, batches[0], multi30k.vocab.pad_id, multi30k.vocab.bos_id, multi30k.vocab.eos_id)
    assert b.src.numel() <= 4096 and b.tgt_out.numel() <= 4096
    assert multi30k.vocab.decode(b.tgt_out[0]) == tr.raw_tgt[int(b.ids[0])]


# ---------------------------------------------------------------------------------------- prefetch
def test_prefetch_yields_every_item_in_order_from_a_thread() -> None:
    producers: list[str] = []

    def items() -> Iterator[int]:
        for i in range(50):
            producers.append(threading.current_thread().name)
            yield i

    assert list(data.prefetch(items(), depth=2)) == list(range(50))
    assert set(producers) == {"nmtcore-prefetch"}  # produced off the consumer's thread
    producers.clear()
    assert list(data.prefetch(items(), depth=0)) == list(range(50))
    assert set(producers) == {threading.current_thread().name}  # depth 0: in the loop, no thread
    with pytest.raises(ValueError, match="depth"):
        next(data.prefetch(items(), depth=-1))


def test_prefetch_raises_a_producers_error_at_its_item() -> None:
    def items() -> Iterator[int]:
        yield 0
        yield 1
        raise RuntimeError("bad batch 2")

    got = []
    with pytest.raises(RuntimeError, match="bad batch 2"):
        for x in data.prefetch(items()):
            got.append(x)
    assert got == [0, 1]


def test_prefetch_closed_early_stops_its_thread_and_reads_at_most_depth_ahead() -> None:
    produced = []

    def items() -> Iterator[int]:
        for i in range(1000):
            produced.append(i)
            yield i

    before = threading.active_count()
    it = data.prefetch(items(), depth=2)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.3)  # the thread fills its queue, then waits
    it.close()
    assert threading.active_count() == before
    assert len(produced) <= 3 + 2 + 1  # consumed, queued, and the one blocked on the full queue
