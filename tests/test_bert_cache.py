"""The frozen-feature cache: hit/miss/invalidation, atomic writes (a killed writer leaves nothing usable),
identical features with and without it, automatic bypass while BERT is fine-tuned or its weights changed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from nmtcore.bert import BertLayer, prepare_bert_inputs, word_start_table
from nmtcore.bert.features import FeatureCache, FeatureKey, inputs_checksum
from nmtcore.config import BertConfig
from nmtcore.data import BertInputs, collate, prepare_data
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.tiny_bert import save_tiny_bert

PAD, BOS, EOS = 0, 2, 3
ROOT = Path(__file__).resolve().parents[1]


def toy_inputs(n: int = 9, seed: int = 0) -> BertInputs:
    rng = np.random.default_rng(seed)
    ids = [np.concatenate([[2], rng.integers(5, 30, rng.integers(1, 12)), [3]]).astype(np.int32) for _ in range(n)]
    return BertInputs(ids=ids, segments=[np.zeros(len(s), np.int8) for s in ids],
                      align=[np.zeros((1, 2), np.int32) for _ in ids], pad_id=0)


class CountingBert:
    """A deterministic stand-in for BERT that counts its calls: state = id + layer offset."""

    def __init__(self, layers: tuple[int, ...] = (0, 2)) -> None:
        self.calls, self.layers = 0, layers

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert not mask[:, 0].any()  # right padding: position 0 is always a real token
        base = ids.float()[..., None, None] + torch.tensor(self.layers, dtype=torch.float)[:, None]  # (B, T, K, 1)
        return base.expand(-1, -1, -1, 4) / 8  # (B, T, K, 4)


def key_for(inputs: BertInputs, **kw) -> FeatureKey:
    base = dict(bert="w" * 64, inputs=inputs_checksum(inputs), layers=(0, 2), max_length=64)
    return FeatureKey(**{**base, **kw})


def test_miss_then_hit_and_rows(tmp_path: Path) -> None:
    inputs, bert = toy_inputs(), CountingBert()
    cache = FeatureCache(tmp_path)
    store = cache.get_or_build(key_for(inputs), inputs, bert, batch_tokens=30)
    built_calls = bert.calls
    assert built_calls > 1  # several batches
    again = FeatureCache(tmp_path).get_or_build(key_for(inputs), inputs, bert)
    assert bert.calls == built_calls  # a hit computes nothing
    for i in range(len(inputs)):
        expect = (inputs.ids[i][:, None, None] + np.array([0, 2])[:, None]) / 8  # (len, K, 1)
        np.testing.assert_array_equal(again.rows(i), np.broadcast_to(expect, (len(inputs.ids[i]), 2, 4)).astype(np.float16))
    g = store.gather(np.array([3, 0]), 20)  # (2, 20, K, H), zero right padding
    assert g.shape == (2, 20, 2, 4) and g.dtype == torch.float16
    assert not g[0, len(inputs.ids[3]):].any()
    sub = store.select(np.array([4, 1]))
    np.testing.assert_array_equal(sub.rows(1), store.rows(1))


@pytest.mark.parametrize("change", [{"bert": "v" * 64}, {"layers": (1, 2)}, {"layers": (1,)}, {"max_length": 32},
                                    "inputs"])
def test_any_key_change_is_a_miss(tmp_path: Path, change) -> None:
    inputs, bert = toy_inputs(), CountingBert()
    cache = FeatureCache(tmp_path)
    cache.get_or_build(key_for(inputs), inputs, bert)
    n = bert.calls
    if change == "inputs":  # another split / corpus / tokenizer / context: another token stream
        other = toy_inputs(seed=1)
        key = key_for(other)
        assert key != key_for(inputs)
        cache.get_or_build(key, other, bert)
    else:
        key = key_for(inputs, **change)
        if "layers" in change:
            bert = CountingBert(change["layers"])
            n = 0
        cache.get_or_build(key, inputs, bert)
    assert bert.calls > n
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_layers_an_entry_holds_among_more_are_read_from_it_as_their_own_build_writes_them(tmp_path: Path) -> None:
    """BERT-JAM's M2 reads the top layer of the states M0 cached for every layer: the same BERT and inputs, so no
    second pass; what it reads is what a build of its own layers writes, row for row."""
    inputs = toy_inputs()
    wide, bert = FeatureCache(tmp_path / "wide"), CountingBert((0, 1, 2))
    wide.get_or_build(key_for(inputs, layers=(0, 1, 2)), inputs, bert, batch_tokens=30)
    n = bert.calls
    top = wide.get_or_build(key_for(inputs, layers=(2,)), inputs, CountingBert((2,)), batch_tokens=30)
    assert bert.calls == n and top.layers == (2,) and top.picks == (2,)
    assert len([d for d in (tmp_path / "wide").iterdir() if d.is_dir()]) == 1  # nothing written
    own = FeatureCache(tmp_path / "own").get_or_build(key_for(inputs, layers=(2,)), inputs, CountingBert((2,)),
                                                      batch_tokens=30)
    for i in range(len(inputs)):
        np.testing.assert_array_equal(top.rows(i), own.rows(i))
    idx = np.array([5, 0, 3])
    assert torch.equal(top.gather(idx, 16), own.gather(idx, 16))
    assert torch.equal(top.select(idx).gather(np.array([2, 1]), 16), own.select(idx).gather(np.array([2, 1]), 16))
    # several layers, in the order the key asks for them; the narrowest holder first
    pair = wide.load(key_for(inputs, layers=(2, 0)))
    np.testing.assert_array_equal(pair.rows(4)[:, 0], wide.load(key_for(inputs, layers=(0, 1, 2))).rows(4)[:, 2])
    assert wide.load(key_for(inputs, layers=(3,))) is None and wide.load(key_for(inputs, layers=(2,),
                                                                                  max_length=32)) is None
    assert wide.load(key_for(inputs, layers=(2,)), n_sentences=len(inputs) + 1) is None


def test_corrupt_entry_is_rebuilt(tmp_path: Path) -> None:
    inputs, bert = toy_inputs(), CountingBert()
    cache = FeatureCache(tmp_path)
    key = key_for(inputs)
    cache.get_or_build(key, inputs, bert)
    feats = cache.entry(key) / "features.npy"
    feats.write_bytes(feats.read_bytes()[:-64])  # truncated
    assert cache.load(key) is None
    n = bert.calls
    store = cache.get_or_build(key, inputs, bert)
    assert bert.calls > n and store.features.shape[0] == int(inputs.lens.sum())


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.test_bert_cache import CountingBert, key_for, toy_inputs
    from nmtcore.bert.features import FeatureCache

    marker = Path({marker!r})
    bert = CountingBert()
    def slow(ids, mask, seg):
        out = bert(ids, mask, seg)
        if bert.calls == 2:
            marker.write_text("half written")
            time.sleep(60)  # killed here, mid-write
        return out
    inputs = toy_inputs()
    FeatureCache(Path({cache!r})).get_or_build(key_for(inputs), inputs, slow, batch_tokens=30)
""")


def test_killed_write_leaves_no_usable_entry(tmp_path: Path) -> None:
    cache_dir, marker = tmp_path / "cache", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER.format(root=str(ROOT), marker=str(marker),
                                                                        cache=str(cache_dir))])
    try:
        deadline = time.time() + 50
        while not marker.exists():
            assert proc.poll() is None, "writer died before reaching the middle of its write"
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    inputs = toy_inputs()
    cache = FeatureCache(cache_dir)
    key = key_for(inputs)
    leftovers = list(cache_dir.glob(f".tmp-{key.digest()}-*"))
    assert leftovers and (leftovers[0] / "features.npy").exists()  # half a file exists ...
    assert not cache.entry(key).exists() and cache.load(key) is None  # ... but is never used
    bert = CountingBert()
    store = cache.get_or_build(key, inputs, bert)  # the next run builds it and clears the leftover
    assert bert.calls > 0 and store.features.shape[0] == int(inputs.lens.sum())
    assert not list(cache_dir.glob(f".tmp-{key.digest()}-*"))


# ---------------------------------------------------------------------------------------------- with a BERT
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("cache")
    bert_dir = save_tiny_bert(tmp / "bert")
    cfg = tiny_experiment(tmp, **{"data.max_tokens": 300})
    data = prepare_data(cfg.data)
    return bert_dir, cfg, data


def test_frozen_features_identical_with_and_without_cache(setup, caplog: pytest.LogCaptureFixture) -> None:
    bert_dir, cfg, data = setup
    layer = BertLayer(BertConfig(name=str(bert_dir)))
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        prepare_bert_inputs(layer, data)
    split = data.splits["valid"]
    assert split.bert.features is not None
    idx = np.arange(0, 40, 3)
    batch = collate(split, idx, PAD, BOS, EOS)
    assert batch.extras["bert_features"].dtype == torch.float16
    layer.train()  # a training step: still served from the cache, still dropout-free
    cached = layer(batch).last
    del batch.extras["bert_features"]
    direct = layer(batch).last
    keep = ~batch.extras["bert_mask"]
    assert cached.dtype == torch.float32
    torch.testing.assert_close(cached[keep], direct[keep], rtol=2e-3, atol=2e-3)  # fp16 storage
    same = (cached[keep] == direct[keep].half().float()).float().mean()
    assert same > 0.99  # bit-identical after fp16 rounding, up to rounding-boundary ties

    # A second "trial": a new BertLayer on the same cache directory loads, computes nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        prepare_bert_inputs(BertLayer(BertConfig(name=str(bert_dir))), data)
    assert sum("cache hit" in r.message for r in caplog.records) == len(data.splits)
    assert not any("computed" in r.message for r in caplog.records)


def test_cache_bypassed_when_fine_tuned_or_weights_changed(setup) -> None:
    bert_dir, cfg, data = setup
    layer = BertLayer(BertConfig(name=str(bert_dir)))
    prepare_bert_inputs(layer, data)
    batch = collate(data.splits["valid"], np.arange(8), PAD, BOS, EOS)
    batch.extras["bert_features"] = torch.full_like(batch.extras["bert_features"], 7.0)  # recognisable
    assert layer.features_usable and (layer(batch).last == 7.0).all()

    # Checkpoint load with other weights: the features no longer describe this BERT.
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    changed = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    layer.load_state_dict(changed)
    assert not layer.features_usable and not (layer(batch).last == 7.0).all()
    layer.load_state_dict(state)
    assert layer.features_usable

    # Unfrozen (fine-tuning phase): BERT runs, and its weights count as changed from then on.
    layer.bert.requires_grad_(True)
    layer.train()
    out = layer(batch).last
    assert out.requires_grad and not (out == 7.0).all()
    layer.bert.requires_grad_(False)
    assert not layer.features_usable  # frozen again, but the weights moved on: never the old features

    # A BERT configured trainable never gets cached features in the first place.
    tuned = BertLayer(BertConfig(name=str(bert_dir), freeze=False))
    prepare_bert_inputs(tuned, data)
    assert data.splits["valid"].bert.features is None
    assert "bert_features" not in collate(data.splits["valid"], np.arange(4), PAD, BOS, EOS).extras


def test_model_without_bert_clears_the_stream(setup) -> None:
    bert_dir, cfg, data = setup
    prepare_bert_inputs(BertLayer(BertConfig(name=str(bert_dir))), data)
    assert data.splits["train"].bert is not None
    prepare_bert_inputs(torch.nn.Linear(2, 2), data)
    assert all(s.bert is None for s in data.splits.values())


def test_feature_store_follows_select(setup) -> None:
    bert_dir, cfg, data = setup
    layer = BertLayer(BertConfig(name=str(bert_dir)))
    prepare_bert_inputs(layer, data)
    split = data.splits["valid"]
    sub = split.select([5, 2])
    a = collate(sub, np.array([0, 1]), PAD, BOS, EOS).extras["bert_features"]
    b = collate(split, np.array([5, 2]), PAD, BOS, EOS).extras["bert_features"]
    assert torch.equal(a, b)
    assert word_start_table(data.vocab).dtype == bool
    assert replace(cfg.data).resolved_cache_dir() in split.bert.features.path.parents


def test_sweep_builds_the_trials_feature_cache_before_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The pre-sweep task builds exactly the cache a trial reads: the trial's trainer then finds every split
    in it and computes nothing; a fine-tuned BERT gets no cache built for it."""
    from nmtcore.engine import build_trainer
    from nmtcore.sweep.pre_sweep import build_features
    from nmtcore.testing.zoo import TINY_BERT

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64})
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        assert build_features(cfg) is True
    assert sum("computed" in r.message for r in caplog.records) == 3  # train, valid, test
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        build_trainer(cfg.with_overrides({"train.seed": 2}))  # another seed of the same arm: same BERT input
    assert sum("cache hit" in r.message for r in caplog.records) == 3
    assert not any("computed" in r.message for r in caplog.records)

    tuned = tiny_experiment(tmp_path / "tuned", **{"model.name": "bert_fused", "model.bert.name": TINY_BERT["name"],
                                                   "model.bert.freeze": False, "model.d_model": 32, "model.ffn_dim": 64})
    assert build_features(tuned) is False
    assert not (Path(tuned.data.cache_dir) / "bert_features").exists()


def test_a_bert_the_first_phase_fine_tunes_gets_no_feature_cache(tmp_path: Path) -> None:
    """BERT-JAM with its BERT trainable from the first update (a fine-tune-only schedule): neither the trainer
    nor the pre-sweep task computes a frozen-feature cache that no batch could read; its default schedule
    (phases 1-2 frozen) still gets one."""
    from nmtcore.engine import build_trainer
    from nmtcore.sweep.pre_sweep import build_features
    from nmtcore.testing.zoo import TINY_BERT

    jam = {"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"], "model.d_model": 32, "model.ffn_dim": 64}
    tuned = tiny_experiment(tmp_path / "tuned", **jam, **{
        "train.phases": [{"name": "finetune", "epochs": 0, "trainable": ["nmt", "glu", "bert"]}]})
    assert build_features(tuned) is False
    trainer = build_trainer(tuned)
    assert all(split.bert is not None and split.bert.features is None for split in trainer.data.splits.values())
    assert any(p.requires_grad for p in trainer.model.bert.parameters())
    assert not (Path(tuned.data.cache_dir) / "bert_features").exists()

    phased = tiny_experiment(tmp_path / "phased", **jam, **{"model.phase_epochs": [1, 1, 1], "train.max_epochs": 3})
    trainer = build_trainer(phased)
    assert all(split.bert.features is not None for split in trainer.data.splits.values())
    assert (Path(phased.data.cache_dir) / "bert_features").is_dir()


def test_feature_build_reports_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """A long build says how far it is (the pre-sweep console turns the count into a bar)."""
    from nmtcore.bert import features as feats

    monkeypatch.setattr(feats, "PROGRESS_S", 0.0)
    inputs = toy_inputs(n=20)
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        FeatureCache(tmp_path).get_or_build(key_for(inputs), inputs, CountingBert(), describe={"split": "train"},
                                            batch_tokens=30)
    counts = [r.message for r in caplog.records if ": sentences " in r.message]
    assert counts and all(m.startswith("BERT features train: sentences ") and m.endswith("/20") for m in counts)
    done = [int(m.split()[-1].split("/")[0]) for m in counts]
    assert done == sorted(done) and done[-1] < 20  # rising; none after the last batch


@pytest.mark.parametrize("first", [1, -1])
def test_stacked_states_are_the_same_from_the_cache_and_per_layer_on_either_layer_axis(first: int) -> None:
    """A model mixing BERT layers reads them stacked (B, Tb, K, H) or layer-major (B, K, Tb, H); from the cache's
    packed float16 tensor (converted and transposed in one pass) the values are those of the per-layer states."""
    from nmtcore.bert.layer import BertOut

    torch.manual_seed(0)
    packed = torch.randn(3, 5, 4, 8).half()  # (B, Tb, K, H)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    cached = BertOut((0, 1, 2, 3), mask, packed=packed)
    per_layer = BertOut((0, 1, 2, 3), mask, states=tuple(packed.float().unbind(2)))
    for dim, want in ((2, packed.float()[:, :, first:]), (1, packed.float()[:, :, first:].transpose(1, 2))):
        for out in (cached, per_layer):
            got = out.stack(first, torch.bfloat16, dim=dim)
            assert got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer axis"):
        cached.stack(1, dim=3)


# ------------------------------------------------------------------------------ shared truncations
def test_one_pass_of_a_bert_builds_its_truncations_features_bit_for_bit(tmp_path: Path, setup) -> None:
    """The size grid's L2 and L4 of one encoder: the L4 pass also writes L2's entries, under L2's own keys, and
    they are byte for byte what L2's own pass writes; L2's BERT never runs."""
    from nmtcore.bert.layer import attach_shared_features
    from nmtcore.bert.truncate import truncate

    _, cfg, data = setup
    full_dir = save_tiny_bert(tmp_path / "full", layers=4)
    cut_dir = truncate("tiny", full_dir, 2, tmp_path / "trunc")
    other_dir = save_tiny_bert(tmp_path / "other", layers=2, seed=1)  # same shape, other weights: no truncation
    ws = word_start_table(data.vocab)

    def stream(bert_dir: Path, layers=(-1,)):
        layer = BertLayer(BertConfig(name=str(bert_dir)), layers=layers)
        return layer, {name: layer.encode_split(split, ws, data) for name, split in data.splits.items()}

    (full, full_in), (cut, cut_in), (other, other_in) = stream(full_dir), stream(cut_dir), stream(other_dir)
    assert cut.truncates(full) and full.truncates(full) and not full.truncates(cut) and not other.truncates(full)
    runs = {"full": 0, "cut": 0, "other": 0}
    for name, layer in (("full", full), ("cut", cut), ("other", other)):
        layer.bert.register_forward_hook(lambda *_, n=name: runs.__setitem__(n, runs[n] + 1))

    shared = FeatureCache(tmp_path / "shared")
    for name in data.splits:
        attach_shared_features(shared, name, [(full, full_in[name]), (cut, cut_in[name]), (other, other_in[name])])
    assert runs["cut"] == 0 and runs["full"] > 0 and runs["other"] > 0  # `other` built its own

    alone = FeatureCache(tmp_path / "alone")
    _, cut_alone = stream(cut_dir)
    for name in data.splits:
        cut.attach_features(alone, name, cut_alone[name])
        full.attach_features(alone, name, full_in[name])  # replaces full_in's store by the alone one
    for name in data.splits:
        a, b = cut_in[name].features, cut_alone[name].features
        assert a.path.name == b.path.name  # the same key: a trial of L2 finds the shared build's entry
        assert a.layers == (2,) and np.array_equal(np.asarray(a.features), np.asarray(b.features))
        assert np.array_equal(a.offsets, b.offsets)
    # The full BERT's own entries were written by the shared pass too: the alone cache's copy equals it.
    for name in data.splits:
        entry = shared.entry(full.features_key(full_in[name]))
        assert np.array_equal(np.load(entry / "features.npy"), np.asarray(full_in[name].features.features))


def test_the_pre_sweep_task_builds_its_truncations_in_its_pass(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``build_features`` of the deeper BERT with the shallower as ``shallower``: every entry a trial of either
    reads exists afterwards, and the shallower's own build then only hits the cache."""
    from nmtcore.bert.truncate import truncate
    from nmtcore.sweep.cost import missing_features
    from nmtcore.sweep.pre_sweep import build_features

    full_dir = save_tiny_bert(tmp_path / "full", layers=4)
    cut_dir = truncate("tiny", full_dir, 2, tmp_path / "trunc")
    deep, shallow = (tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": str(d),
                                                  "data.max_tokens": 300}) for d in (full_dir, cut_dir))
    assert missing_features(shallow, prepare_data(shallow.data))[0] > 0
    with caplog.at_level(logging.INFO, logger="nmtcore"):
        assert build_features(deep, shallower=[shallow])
    assert any("computed in the same pass" in r.message for r in caplog.records)
    assert missing_features(shallow, prepare_data(shallow.data))[0] == 0
    assert missing_features(deep, prepare_data(deep.data))[0] == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        assert build_features(shallow)
    assert not any("computed" in r.message for r in caplog.records)


def test_the_pre_sweep_task_writes_each_entry_once_when_streams_read_the_same_features(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two streams of a grid that read the same features (BERT-JAM's M0 and M1 read every layer of one BERT) make
    one entry per split, written once, and the shared pass names only the distinct truncations."""
    from nmtcore.bert.truncate import truncate
    from nmtcore.sweep.pre_sweep import build_features

    full_dir = save_tiny_bert(tmp_path / "full", layers=4)
    cut_dir = truncate("tiny", full_dir, 2, tmp_path / "trunc")
    deep, twin, shallow = (tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": str(d),
                                                        "data.max_tokens": 300, "name": n})
                           for d, n in ((full_dir, "a"), (full_dir, "b"), (cut_dir, "c")))
    with caplog.at_level(logging.INFO, logger="nmtcore"):
        assert build_features(deep, shallower=[twin, shallow])
    written = [r.getMessage() for r in caplog.records if ": computed " in r.getMessage()]
    splits = prepare_data(deep.data).splits
    assert len(written) == 2 * len(splits)  # the deep and the cut BERT's entry per split, each once
    assert len({m.rsplit("-> ", 1)[1] for m in written}) == len(written)
    same_pass = [r.getMessage() for r in caplog.records if "computed in the same pass" in r.getMessage()]
    assert len(same_pass) == 1 and same_pass[0].count("layer") == 2, same_pass
