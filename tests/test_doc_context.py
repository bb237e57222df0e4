"""BERT as a document-level context encoder (seed 003): document corpora (``<d>`` markers, CRLF), context
that never crosses a document boundary, the ``[CLS] ctx [SEP] cur [SEP]`` stream and its segment ids, the
real / random / fixed contexts (Table 4), the integration switch (Table 3) and the context gates (Eq. 4, 6)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nmtcore.bert import (
    BertLayer,
    nmt_word_index,
    prepare_bert_inputs,
    word_start_table,
)
from nmtcore.checkpoint import save_checkpoint
from nmtcore.config import BertConfig, ConfigError, DataConfig, ExperimentConfig
from nmtcore.config.families import DEFAULT_FIXED_CONTEXT
from nmtcore.data import (
    DOC_MARKER,
    DataError,
    DocumentIndex,
    corpus_file,
    encode_split,
    load_split,
    prepare_data,
)
from nmtcore.engine import warm_start
from nmtcore.models import build_model
from nmtcore.models.doc_context import DocContext, DocContextSource
from nmtcore.testing.synthetic import SRC_WORDS, TGT_WORDS
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB, with_inputs

NO_DROPOUT = {**TINY, "dropout": 0.0}


def doc_model(seed: int = 0, **fields):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {"name": "doc_context", **NO_DROPOUT, "bert": TINY_BERT, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS), cfg


def baseline(seed: int = 0):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {"name": "transformer", **NO_DROPOUT}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS), cfg


# ---------------------------------------------------------------------- a hand-made document corpus
def write_crlf(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(line + "\r\n" for line in lines).encode("utf-8"))  # CRLF, as the TED files


def doc_corpus(root: Path, docs_per_split: int = 30, seed: int = 0) -> dict[str, list[list[str]]]:
    """``{split}.{en,de}`` files with a ``<d>`` line before each document (CRLF line endings); returns each
    split's documents (source side) as written. Every source sentence is distinct."""
    rng = random.Random(seed)
    out: dict[str, list[list[str]]] = {}
    n = 0
    for split in ("train", "val", "test"):
        src_lines, tgt_lines, docs = [], [], []
        for _ in range(docs_per_split):
            doc = []
            src_lines.append(DOC_MARKER)
            tgt_lines.append(DOC_MARKER)
            for _ in range(rng.randint(1, 5)):
                idx = [rng.randrange(len(SRC_WORDS)) for _ in range(rng.randint(2, 6))] + [n % 12, n // 12 % 12]
                n += 1
                src = " ".join(SRC_WORDS[i] for i in idx)
                src_lines.append(src)
                tgt_lines.append(" ".join(TGT_WORDS[i] for i in idx))
                doc.append(src)
            docs.append(doc)
        write_crlf(root / f"{split}.en", src_lines)
        write_crlf(root / f"{split}.de", tgt_lines)
        out[split] = docs
    return out


def data_cfg(root: Path, cache: Path, **kw) -> DataConfig:
    base = dict(corpus="docparallel", data_dir=str(root), cache_dir=str(cache), src_lang="en", tgt_lang="de",
                valid_split="val", test_splits=("test",), vocab_size=40, download=False)
    return DataConfig(**{**base, **kw})


def expected_previous(docs: list[list[str]], n: int) -> dict[str, list[str]]:
    """sentence → its up to n predecessors in its own document."""
    return {s: doc[max(0, i - n):i] for doc in docs for i, s in enumerate(doc)}


def test_markers_are_dropped_and_documents_numbered(tmp_path):
    docs = doc_corpus(tmp_path)
    pt = load_split(data_cfg(tmp_path, tmp_path / "c"), "train")
    assert pt.src == [s for doc in docs["train"] for s in doc]  # no <d> pair, no CR left
    assert DOC_MARKER not in pt.src and DOC_MARKER not in pt.tgt and not any("\r" in s for s in pt.src + pt.tgt)
    assert pt.doc_ids.tolist() == [d for d, doc in enumerate(docs["train"]) for _ in doc]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_context_never_crosses_a_document_boundary(tmp_path, n):
    docs = doc_corpus(tmp_path)
    pt = load_split(data_cfg(tmp_path, tmp_path / "c"), "train")
    index = DocumentIndex.from_doc_ids(pt.src, pt.doc_ids)
    want = expected_previous(docs["train"], n)
    assert index.previous(n) == [want[s] for s in pt.src]
    # A selection (length filter, batching) keeps each sentence's own context.
    sel = [7, 3, 0, len(pt.src) - 1]
    assert index.select(sel).previous(n) == [want[pt.src[i]] for i in sel]


def test_bad_document_files_are_one_line_errors(tmp_path):
    write_crlf(tmp_path / "train.en", [DOC_MARKER, "ka lo", DOC_MARKER, "mi nu"])
    write_crlf(tmp_path / "train.de", [DOC_MARKER, "Hund Katze", "Baum Haus", DOC_MARKER])
    want = r"document markers differ: line 3 is <d> in .*train.en but not in .*train.de"
    with pytest.raises(DataError, match=want) as e:
        load_split(data_cfg(tmp_path, tmp_path / "c"), "train")
    assert "\n" not in str(e.value)
    for lang in ("en", "de"):
        write_crlf(tmp_path / f"train.{lang}", [DOC_MARKER, DOC_MARKER])
    with pytest.raises(DataError, match="holds only <d> document markers") as e:
        load_split(data_cfg(tmp_path, tmp_path / "c"), "train")
    assert "\n" not in str(e.value)


def test_shared_ted_documents_read_as_published(shared_data):
    """Maruf et al. (2019) TED dev: 93 documents, 8,967 sentences (PROVENANCE.md), CRLF stripped."""
    SHARED_DATA = shared_data
    if not (SHARED_DATA / "docnmt-en-de-maruf2019-devtest" / "IWSLT2017").is_dir():
        pytest.skip("shared document corpus not found")
    pt = load_split(DataConfig(corpus="maruf2019_ted", data_dir=str(SHARED_DATA)), "dev")
    assert len(pt) == 8967 and len(np.unique(pt.doc_ids)) == 93
    assert not any("\r" in s or s == DOC_MARKER for s in pt.src + pt.tgt)
    with pytest.raises(DataError, match="corpus 'maruf2019_ted', split 'train': missing files .*selective-attn"):
        load_split(DataConfig(corpus="maruf2019_ted", data_dir=str(SHARED_DATA)), "train")


def maruf_layout(root: Path) -> dict[tuple[str, str], list[list[str]]]:
    """The three Maruf et al. sub-corpora's dev and test files under ``root`` (their real layout and names)."""
    out = {}
    for i, sub in enumerate(("IWSLT2017", "NC-2016", "Europarl7")):
        made = doc_corpus(root / "tmp" / sub, docs_per_split=3 + i, seed=i)
        for split, src in (("dev", "train"), ("test", "test")):
            for lang in ("en", "de"):
                dest = root / "docnmt-en-de-maruf2019-devtest" / sub / f"concatenated_en2de_{split}_{lang}.txt"
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes((root / "tmp" / sub / f"{src}.{lang}").read_bytes())
            out[sub, split] = made[src]
    return out


def test_the_joined_offline_document_corpus(tmp_path):
    """``maruf2019_devtest``: the three dev sets joined train (in order, documents kept apart), News test validates,
    TED test tests; the prepared data's checksum of a joined split changes with any one of its files."""
    made = maruf_layout(tmp_path)
    cfg = DataConfig(corpus="maruf2019_devtest", data_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"),
                     valid_split="valid", test_splits=("test",), vocab_size=40, download=False)
    train = load_split(cfg, "train")
    dev_docs = [d for sub in ("IWSLT2017", "NC-2016", "Europarl7") for d in made[sub, "dev"]]
    assert train.src == [s for d in dev_docs for s in d]
    assert [[s for s, k in zip(train.src, train.doc_ids) if k == doc] for doc in np.unique(train.doc_ids)] == dev_docs
    assert [p.parent.name for p, _ in train.files] == ["IWSLT2017", "NC-2016", "Europarl7"]
    assert load_split(cfg, "valid").src == [s for d in made["NC-2016", "test"] for s in d]
    assert load_split(cfg, "test").src == [s for d in made["IWSLT2017", "test"] for s in d]
    before = prepare_data(cfg).checksums
    europarl = tmp_path / "docnmt-en-de-maruf2019-devtest" / "Europarl7" / "concatenated_en2de_dev_de.txt"
    europarl.write_bytes(europarl.read_bytes()[:-2] + b" x\r\n")  # its last sentence, one word longer
    after = prepare_data(cfg).checksums
    assert after["train.de"] != before["train.de"] and after["train.en"] == before["train.en"]
    assert after["valid.de"] == before["valid.de"]
    with pytest.raises(DataError, match="has no file of its own: its split 'train' joins maruf2019_ted dev"):
        corpus_file(cfg, "train", "en")


def test_shared_joined_document_corpus(shared_data):
    """The offline document-level training set of the doc-context studies: 14,723 sentences in 414 documents."""
    if not (shared_data / "docnmt-en-de-maruf2019-devtest" / "Europarl7").is_dir():
        pytest.skip("shared document corpus not found")
    cfg = DataConfig(corpus="maruf2019_devtest", data_dir=str(shared_data))
    train = load_split(cfg, "train")
    assert (len(train), len(np.unique(train.doc_ids))) == (8967 + 2169 + 3587, 93 + 81 + 240)
    assert (len(load_split(cfg, "valid")), len(load_split(cfg, "test"))) == (2999, 2271)


def test_the_bert_stream_of_a_prepared_document_corpus(tmp_path):
    """End to end: prepare_data keeps the documents through the length filter, prepare_bert_inputs builds
    ``[CLS] previous [SEP] current [SEP]`` from the same document only (segments 0 / 1)."""
    docs = doc_corpus(tmp_path)
    long = " ".join(["ka"] * 200)  # over max_len: filtered from train, but still its successor's context
    lines = (tmp_path / "train.en").read_bytes().decode().split("\r\n")
    doc = next(d for d in docs["train"] if len(d) >= 2)
    lines[lines.index(doc[0])] = long
    (tmp_path / "train.en").write_bytes("\r\n".join(lines).encode())
    doc[0] = long
    data = prepare_data(data_cfg(tmp_path, tmp_path / "cache", max_len=150, max_len_ratio=1000.0))
    assert data.train_dropped == 1 and long not in data.train.raw_src
    model, _ = doc_model()
    bl = prepare_bert_inputs(model, data, use_cache=False)
    enc = bl.encoder
    for name, split in data.splits.items():
        want = expected_previous(docs[name], 1)
        for i, cur in enumerate(split.raw_src):
            prev = want[cur]
            ref = enc.encode([cur], contexts=[prev[0] if prev else None])
            assert split.bert.ids[i].tolist() == ref.ids[0].tolist(), (name, i)
            assert split.bert.segments[i].tolist() == ref.segments[0].tolist(), (name, i)
    second = data.train.raw_src.index(doc[1])
    ctx = data.train.bert.ids[second][1 : data.train.bert.segments[second].tolist().index(1) - 1]
    assert len(ctx) > 30 and enc.backend.decode(ctx.tolist()).split() == ["ka"] * len(ctx)  # its (cut) context


# ---------------------------------------------------------------------- BERT input and segment ids
@pytest.fixture(scope="module")
def split_and_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    doc_corpus(root)
    data = prepare_data(data_cfg(root, root / "cache"))
    return data


def test_segment_ids_of_cls_ctx_sep_cur_sep(split_and_vocab):
    layer = BertLayer(BertConfig(name=TINY_BERT["name"]))
    layer.context_source = lambda split, data: ["ka lo"] * len(split)
    split = encode_split(split_and_vocab.vocab, "x", ["mi nu pe"])
    ws = word_start_table(split_and_vocab.vocab)
    inputs = layer.encode_split(split, ws)
    tok = layer.encoder.backend
    assert [tok.id_to_token(i) for i in inputs.ids[0]] == ["[CLS]", "ka", "lo", "[SEP]", "mi", "nu", "pe", "[SEP]"]
    assert inputs.segments[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    words = nmt_word_index(split.src[0], ws)  # NMT source positions point into the current sentence (segment 1)
    assert [tuple(inputs.align[0][p]) for p in range(len(words))] == [[(4, 5), (5, 6), (6, 7)][w] for w in words]


def test_bert_context_previous_follows_documents(split_and_vocab):
    """``model.bert.context=previous`` (any BERT model) on a document corpus: the previous sentence of the
    same document, nothing at a document start."""
    data = split_and_vocab
    layer = BertLayer(BertConfig(name=TINY_BERT["name"], context="previous"))
    inputs = layer.encode_split(data.valid, word_start_table(data.vocab))
    prev = data.valid.docs.previous(1)
    ref = layer.encoder.encode(data.valid.raw_src, contexts=[p[0] if p else None for p in prev])
    assert [x.tolist() for x in inputs.ids] == [x.tolist() for x in ref.ids]
    assert [x.tolist() for x in inputs.segments] == [x.tolist() for x in ref.segments]
    assert any(not p for p in prev[1:])  # the split has document starts past its first line


def test_fixed_context_is_one_sentence_everywhere(split_and_vocab):
    model, _ = doc_model(context_type="fixed", fixed_context="  ka   lo mi ")
    valid = split_and_vocab.valid
    assert model.bert.context_source(valid, split_and_vocab) == ["ka lo mi"] * len(valid)
    no_docs = encode_split(split_and_vocab.vocab, "input", ["ka lo", "mi nu"])  # fixed needs no documents
    assert model.bert.context_source(no_docs) == ["ka lo mi"] * 2
    assert doc_model(context_type="fixed")[1].model.fixed_context == DEFAULT_FIXED_CONTEXT


def test_random_context_matches_the_real_one_in_length_only(split_and_vocab):
    data = split_and_vocab
    real = DocContextSource(doc_model(context_type="real")[1].model)(data.valid, data)
    rand_src = DocContextSource(doc_model(context_type="random")[1].model)
    rand = rand_src(data.valid, data)
    vocab = {w for line in data.train.raw_src for w in line.split()}
    for r, x in zip(real, rand):
        assert (r is None) == (x is None)  # a document start stays empty
        if r is not None:
            assert len(x.split()) == len(r.split()) and set(x.split()) <= vocab
    assert sum(r != x for r, x in zip(real, rand)) > len(real) // 2
    assert rand_src(data.valid, data) == rand  # drawn once: the same every epoch (cacheable)
    other_seed = DocContextSource(doc_model(context_type="random", random_context_seed=2)[1].model)(data.valid, data)
    assert other_seed != rand


@pytest.mark.parametrize("context_type", ["real", "random"])
def test_real_and_random_contexts_need_documents(split_and_vocab, context_type):
    model, _ = doc_model(context_type=context_type)
    no_docs = encode_split(split_and_vocab.vocab, "input", ["ka lo", "mi nu"])
    with pytest.raises(DataError, match=rf"split 'input' has no documents: model.context_type={context_type}") as e:
        model.bert.context_source(no_docs)
    assert "\n" not in str(e.value)


def test_real_context_is_the_previous_sentence_of_the_document(split_and_vocab):
    data = split_and_vocab
    model, _ = doc_model(context_sentences=2)
    got = model.bert.context_source(data.valid, data)
    prev = data.valid.docs.previous(2)
    assert got == [" ".join(p) or None for p in prev]
    starts = np.flatnonzero(np.r_[True, np.diff(data.valid.docs.doc_ids) != 0])
    assert all(got[i] is None for i in starts)


# ---------------------------------------------------------------------- the model
def test_integration_none_is_the_sentence_level_transformer(small_batch):
    """Table 3 "none": no BERT, the baseline's parameters (same names, same init), same outputs whatever
    the BERT stream (context) says."""
    model, _ = doc_model(context_integration="none")
    base, _ = baseline()
    assert model.bert is None and not any(isinstance(m, BertLayer) for m in model.modules())
    sd, bsd = model.state_dict(), base.state_dict()
    assert sd.keys() == bsd.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], bsd[k], rtol=0, atol=0)
    model.eval(), base.eval()
    batch = with_inputs(model, small_batch)
    with torch.no_grad():
        out = model(batch).logits
        torch.testing.assert_close(out, base(small_batch).logits, rtol=0, atol=0)
        batch.extras["bert_ids"] = torch.flip(batch.extras["bert_ids"], [1])  # another "context"
        torch.testing.assert_close(model(batch).logits, out, rtol=0, atol=0)


@pytest.mark.parametrize("integration", ["encoder", "decoder", "both"])
def test_the_context_reaches_the_output(small_batch, integration):
    model, _ = doc_model(context_integration=integration)
    model.eval()
    batch = with_inputs(model, small_batch)
    with torch.no_grad():
        out = model(batch).logits
        ids = batch.extras["bert_ids"]
        batch.extras["bert_ids"] = torch.where(batch.extras["bert_mask"], ids, (ids - 5 + 3) % 20 + 5)
        assert not torch.allclose(model(batch).logits, out)


def test_warm_start_from_the_baseline_leaves_only_context_parts_fresh(tmp_path):
    base, bcfg = baseline(seed=1)
    path = save_checkpoint(tmp_path / "base.pt", {"model": base.state_dict(), "config": bcfg.to_dict(),
                                                  "vocab": {"checksum": "v1"}})
    model, cfg = doc_model(seed=2)
    report = warm_start(model, path, cfg, SimpleNamespace(checksum="v1"))
    assert set(report.loaded) == set(base.state_dict())
    assert report.fresh and all(".bert_attn." in k or ".gate." in k or k.startswith("bert.") for k in report.fresh)
    assert any(".gate." in k for k in report.fresh) and any(".bert_attn." in k for k in report.fresh)
    assert all(not p.requires_grad for p in model.parameter_groups()["bert"])  # BERT frozen (Sec. 3.2)


@pytest.mark.parametrize("integration, bias", [("encoder", 60.0), ("decoder", -60.0)])
def test_saturated_gates_reduce_to_the_baseline(small_batch, integration, bias):
    """Eq. 4 with g → 1 is the encoder's self-attention alone; Eq. 6 with d → 0 is the decoder's encoder
    attention alone: warm-started from a baseline, the model then gives the baseline's logits."""
    base, bcfg = baseline(seed=1)
    model, _ = doc_model(seed=2, context_integration=integration, gate_bias_init=bias)
    missing = model.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(".bert_attn." in k or ".gate." in k or k.startswith("bert.") for k in missing)
    model.eval(), base.eval()
    with torch.no_grad():
        got = model(with_inputs(model, small_batch)).logits
        torch.testing.assert_close(got, base(small_batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("integration, switches", [
    ("encoder", {"tested", "enc_bert_off", "bert_off"}), ("decoder", {"tested", "dec_bert_off", "bert_off"}),
    ("both", {"tested", "enc_bert_off", "dec_bert_off", "bert_off"}), ("none", set())])
def test_switching_the_context_off_gives_the_sentence_level_model(small_batch, integration, switches):
    """``bert_off`` passes each gate's sentence branch alone (Eq. 4's g = 1, Eq. 6's d = 0): warm-started from a
    baseline, whatever its gates learnt, the model then gives the baseline's logits; one stack's switch leaves the
    other stack's context in; after the block the tested model is back."""
    base, _ = baseline(seed=1)
    model, _ = doc_model(seed=2, context_integration=integration)
    assert set(model.inference_switches()) == switches
    if not switches:
        return
    model.load_state_dict(base.state_dict(), strict=False)
    model.eval(), base.eval()
    batch = with_inputs(model, small_batch)
    on = model.inference_switches()
    with torch.no_grad():
        tested = model(batch).logits
        with on["bert_off"]():
            torch.testing.assert_close(model(batch).logits, base(small_batch).logits, rtol=1e-5, atol=1e-5)
        if integration == "both":
            for name in ("enc_bert_off", "dec_bert_off"):
                with on[name]():
                    one = model(batch).logits
                assert not torch.allclose(one, tested) and not torch.allclose(one, base(small_batch).logits)
        torch.testing.assert_close(model(batch).logits, tested, rtol=0, atol=0)


def test_gate_combines_per_dimension():
    """Eq. 4: A = g ⊙ B + (1 − g) ⊙ D with g = σ(W [B; D] + b)."""
    from nmtcore.models.doc_context import ContextGate

    torch.manual_seed(0)
    gate = ContextGate(8, 0.0, context_first=False)
    b, d = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    g = torch.sigmoid(torch.cat([b, d], -1) @ gate.proj.weight.T + gate.proj.bias)
    torch.testing.assert_close(gate(b, d), g * b + (1 - g) * d)


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("fields, match", [
    ({"context_integration": "encoder+decoder"},
     r"^model.context_integration: must be one of none, encoder, decoder, both, got 'encoder\+decoder'"),
    ({"context_type": "previous"}, r"^model.context_type: must be one of real, random, fixed, got 'previous'"),
    ({"context_sentences": 0}, r"^model.context_sentences: must be >= 1"),
    ({"fixed_context": "  "}, r"^model.fixed_context: must not be empty"),
    ({"bert": {**TINY_BERT, "context": "previous"}}, r"^model.bert.context: doc_context builds its own context"),
])
def test_bad_switch_values_are_one_line_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        ExperimentConfig.from_dict({"model": {"name": "doc_context", "bert": TINY_BERT, **fields}})
    assert "\n" not in str(e.value)


def test_a_bert_is_needed_unless_integration_is_none():
    with pytest.raises(ConfigError, match=r"^model.bert.name: doc_context with context_integration=both needs a BERT"):
        ExperimentConfig.from_dict({"model": {"name": "doc_context"}})
    cfg = ExperimentConfig.from_dict({"model": {"name": "doc_context", "context_integration": "none", **TINY}})
    assert isinstance(build_model(cfg.model, VOCAB, PAD, BOS, EOS), DocContext)


# ---------------------------------------------------------------------- end to end
def baseline_then_doc_model(tmp_path: Path, epochs: int) -> ExperimentConfig:
    """A tiny document corpus and a sentence-level baseline trained ``epochs`` epochs on it; returns the config of
    the document model warm-started from the baseline's last epoch (BERT frozen), not yet trained."""
    from nmtcore.engine import run_experiment

    doc_corpus(tmp_path / "data")
    base = {"name": "doc", "output_dir": str(tmp_path / "base"),
            "data": {"corpus": "docparallel", "data_dir": str(tmp_path / "data"), "src_lang": "en", "tgt_lang": "de",
                     "valid_split": "val", "test_splits": ["test"], "vocab_size": 40, "max_tokens": 600,
                     "cache_dir": str(tmp_path / "cache")},
            "model": {"name": "transformer", **NO_DROPOUT},
            "train": {"lr": 3e-3, "warmup_updates": 10, "max_epochs": epochs, "precision": "fp32", "valid_bleu": False},
            "decode": {"beam": 2, "max_sentences": 50}}
    run_experiment(ExperimentConfig.from_dict(base))
    return ExperimentConfig.from_dict(base).with_overrides({
        "output_dir": str(tmp_path / "doc"), "model.name": "doc_context", "model.bert.name": TINY_BERT["name"],
        "train.init_from": str(tmp_path / "base" / "checkpoints" / f"epoch{epochs}.pt")})


def test_warm_started_document_model_trains_and_decodes(tmp_path):
    """The paper's procedure on a tiny document corpus: a sentence-level baseline, then the document model
    warm-started from its checkpoint (only context attention, gates and BERT fresh; BERT frozen)."""
    from nmtcore.engine import run_experiment

    cfg = baseline_then_doc_model(tmp_path, epochs=1)
    summary = run_experiment(cfg)
    assert summary.warm_start.loaded == len(baseline()[0].state_dict())
    assert summary.trainable_parameters < summary.parameters  # the BERT stays frozen
    hyps = Path(summary.test["test"].hyp_path).read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(load_split(data_cfg(tmp_path / "data", tmp_path / "cache"), "test"))
