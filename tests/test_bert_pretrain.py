"""Small-BERT pretraining: a loadable, cached, deterministic BERT of any L×H from a monolingual corpus,
its held-out MLM accuracy, resolution by name, automatic pretraining of an unreachable size, the CLI."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from nmtcore.bert import BertSpec, ensure_bert, resolve_bert
from nmtcore.bert.made_here import DEFAULT_STEPS, PretrainSpec
from nmtcore.bert.pretrain import pretrain_bert
from nmtcore.config import BertConfig, DataConfig
from nmtcore.files import sha256_file as file_sha256
from nmtcore.models import build_model
from nmtcore.testing.synthetic import SRC_WORDS, tiny_experiment, write_corpus

TINY = dict(layers=1, hidden=64, corpus="parallel", lang="xx", steps=12, vocab_size=64, max_length=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    root = tmp_path_factory.mktemp("pre")
    data_dir = write_corpus(root / "data", n_train=400, n_eval=60)
    return DataConfig(corpus="parallel", data_dir=str(data_dir), src_lang="xx", tgt_lang="yy",
                      valid_split="valid", cache_dir=str(root / "cache"))


@pytest.fixture(scope="module")
def pretrained(corpus: DataConfig):
    return pretrain_bert(PretrainSpec(**TINY), corpus, threads=1)


def test_names_round_trip() -> None:
    spec = PretrainSpec(4, 256, "multi30k", "de")
    assert spec.name == "pretrained-here:L4-H256:multi30k:de"
    assert PretrainSpec.parse(spec.name) == spec
    other = PretrainSpec(2, 128, "multi30k", "en", steps=50, seed=3)
    assert other.name == "pretrained-here:L2-H128:multi30k:en:steps=50:seed=3"
    assert PretrainSpec.parse(other.name) == other
    assert BertConfig().pretrain_steps == 0  # the recipe's default
    assert PretrainSpec.for_size(2, 128, "multi30k:en", 0).steps == DEFAULT_STEPS


def test_pretrained_bert_is_a_loadable_directory(pretrained, corpus: DataConfig) -> None:
    from transformers import AutoTokenizer, BertModel

    path = pretrained.path
    assert not pretrained.cached
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "meta.json"):
        assert (path / f).is_file(), f
    model = BertModel.from_pretrained(path)
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (1, 64)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.tokenize(" ".join(SRC_WORDS[:3])) == SRC_WORDS[:3]  # its own WordPiece vocabulary
    meta = json.loads((path / "meta.json").read_text())
    assert meta["corpus_sha256"] == file_sha256(Path(corpus.data_dir) / "train.xx")
    assert meta["heldout"] == "parallel valid.xx"
    m = pretrained.metrics
    assert 0 <= m["heldout_mlm_accuracy"] <= 1 and m["heldout_predictions"] > 0
    assert path.parts[-3:-1] == ("parallel.xx", "L1-H64.steps12.seed1.v64.len16")  # the cache key, readable


def test_cached_by_key_and_resolvable_by_name(pretrained, corpus: DataConfig) -> None:
    t0 = time.perf_counter()
    again = pretrain_bert(PretrainSpec(**TINY), corpus)
    assert again.cached and again.path == pretrained.path and time.perf_counter() - t0 < 2
    r = resolve_bert(BertSpec(PretrainSpec(**TINY).name), cache_dir=corpus.cache_dir, allow_network=False)
    assert r.path == pretrained.path.resolve() and r.source == "pretrained here"


def test_deterministic_for_a_seed(pretrained, corpus: DataConfig, tmp_path: Path) -> None:
    other_cache = DataConfig(**{**corpus.__dict__, "cache_dir": str(tmp_path)})
    twin = pretrain_bert(PretrainSpec(**TINY), other_cache, threads=1)
    assert file_sha256(twin.path / "model.safetensors") == file_sha256(pretrained.path / "model.safetensors")
    assert twin.metrics["heldout_mlm_accuracy"] == pretrained.metrics["heldout_mlm_accuracy"]
    reseeded = pretrain_bert(PretrainSpec(**{**TINY, "seed": 2}), other_cache, threads=1)
    assert reseeded.path != twin.path
    assert file_sha256(reseeded.path / "model.safetensors") != file_sha256(twin.path / "model.safetensors")


def test_rng_of_the_caller_untouched(corpus: DataConfig, tmp_path: Path) -> None:
    torch.manual_seed(7)
    expect = torch.rand(3)
    torch.manual_seed(7)
    pretrain_bert(PretrainSpec(**{**TINY, "steps": 2}), DataConfig(**{**corpus.__dict__, "cache_dir": str(tmp_path)}))
    assert torch.equal(torch.rand(3), expect)


def test_ensure_bert_pretrains_an_unreachable_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMTCORE_OFFLINE", "1")
    cfg = tiny_experiment(tmp_path, **{"model.bert.layers": 1, "model.bert.hidden": 64,
                                       "model.bert.pretrain_steps": 3, "train.kd_alpha": 0.9})
    resolved = ensure_bert(cfg)
    bc = resolved.model.bert
    assert (bc.layers, bc.hidden, bc.pretrain_corpus) == (1, 64, "parallel:xx")
    assert bc.cache_dir == str(cfg.data.resolved_cache_dir())
    model = build_model(resolved.model, 96, 0, 2, 3)
    teacher = model.kd.teacher.resolved
    assert teacher.source == "pretrained here" and teacher.name == "pretrained-here:L1-H64:parallel:xx:steps=3"
    t0 = time.perf_counter()
    assert ensure_bert(cfg) == resolved and time.perf_counter() - t0 < 5  # idempotent, nothing retrained


def test_cli_bert_pretrain(corpus: DataConfig, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from nmtcore.cli import main

    args = ["bert-pretrain", "--layers", "1", "--hidden", "64", "--corpus", "parallel", "--lang", "xx",
            "--steps", "3", "--vocab-size", "64", "--max-length", "16", "--data-dir", corpus.data_dir,
            "--cache-dir", str(tmp_path), "--threads", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{\n"):])
    assert result["name"] == "pretrained-here:L1-H64:parallel:xx:steps=3:vocab=64:maxlen=16"
    assert "heldout_mlm_accuracy" in result and "held-out MLM accuracy" in out
    assert main(args[:-4] + ["--corpus", "nope", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown corpus 'nope'" in err
    assert main(args[:2] + ["3", "--hidden", "100"]) == 2
    assert "multiple of 64" in capsys.readouterr().err


@pytest.mark.slow
def test_multi30k_small_bert_learns_beyond_unigrams(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                    shared_data: Path) -> None:
    """``nmtcore bert-pretrain --layers 2 --hidden 128`` on Multi30k En ends with a BERT that predicts masked
    tokens well above the unigram baseline. Its time (the issue's bar: 5 min on 2 cores) is a benchmark's
    figure, printed here, not asserted: a timed test fails on a busy machine and proves nothing on a fast one."""
    from nmtcore.cli import main

    t0 = time.perf_counter()
    assert main(["bert-pretrain", "--layers", "2", "--hidden", "128", "--data-dir", str(shared_data),
                 "--cache-dir", str(tmp_path), "--threads", "2", "--no-download"]) == 0
    wall = time.perf_counter() - t0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{\n"):])
    assert result["heldout_mlm_accuracy"] > result["unigram_baseline_accuracy"] + 0.1, result
    with capsys.disabled():
        print(f"\nbert-pretrain L2/H128 on Multi30k En: {wall:.0f} s, load average {os.getloadavg()[0]:.1f}")
