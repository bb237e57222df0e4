"""BERT-fused identities (seed 002): drop-net (Eq. 3) and its inference average (Eq. 1), reproducible
drop-net draws, the fine-tune switch, and the warm start from a baseline checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nmtcore.checkpoint import CheckpointError, save_checkpoint
from nmtcore.config import ConfigError, ExperimentConfig
from nmtcore.engine import warm_start
from nmtcore.models import build_model
from nmtcore.nn import DropNet
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB, with_inputs

NO_DROPOUT = {**TINY, "dropout": 0.0}


def fused(seed: int = 0, **fields):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {"name": "bert_fused", **NO_DROPOUT, "bert": TINY_BERT, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS), cfg


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"^model.bert.name: bert_fused needs a BERT"):
        ExperimentConfig.from_dict({"model": {"name": "bert_fused"}})
    with pytest.raises(ConfigError, match=r"^model.p_net: must be in \[0, 1\]"):
        ExperimentConfig.from_dict({"model": {"name": "bert_fused", "p_net": 1.5, "bert": TINY_BERT}})


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_drop_net_branch_frequencies_match_p_net(p):
    """U < p/2 → first branch, U > 1 − p/2 → second, else the average: frequencies p/2, p/2, 1 − p."""
    dn = DropNet(p, seed=7).train()
    n = 20000
    draws = [dn.weights() for _ in range(n)]
    # Each draw is Eq. 3 applied to the U of the module's seeded generator, replayed here independently.
    gen = torch.Generator().manual_seed(7)
    us = [torch.rand((), generator=gen).item() for _ in range(n)]
    assert draws == [(1.0, 0.0) if u < p / 2 else (0.0, 1.0) if u > 1 - p / 2 else (0.5, 0.5) for u in us]
    first = draws.count((1.0, 0.0)) / n
    second = draws.count((0.0, 1.0)) / n
    both = draws.count((0.5, 0.5)) / n
    assert first == pytest.approx(p / 2, abs=0.012)
    assert second == pytest.approx(p / 2, abs=0.012)
    assert both == pytest.approx(1 - p, abs=0.012)


def test_drop_net_is_the_average_at_inference():
    dn = DropNet(1.0, seed=7).eval()
    assert {dn.weights() for _ in range(100)} == {(0.5, 0.5)}


def test_drop_net_draws_are_seeded_and_resume_exactly():
    """Same seed → same U sequence; the generator state is in state_dict, so a reload continues it."""
    a, b = DropNet(0.5, seed=3), DropNet(0.5, seed=3)
    assert [a.draw() for _ in range(50)] == [b.draw() for _ in range(50)]
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    expected = [a.draw() for _ in range(20)]
    c = DropNet(0.5, seed=999)
    c.load_state_dict(saved)
    assert [c.draw() for _ in range(20)] == expected
    assert DropNet(0.5, seed=4).draw() != DropNet(0.5, seed=3).draw()


def test_layers_compute_eq1_average_in_eval_and_single_branches_under_drop_net(small_batch):
    model, _ = fused(p_net=1.0)
    model.eval()
    batch = with_inputs(model, small_batch)
    bert_out = model.bert(batch)
    layer = model.encoder_layers[0]
    x = model.embed(batch.src, model.src_embed)
    with torch.no_grad():
        h = layer.self_res.before(x)
        a = layer.self_attn(h, key_padding_mask=batch.src_mask)
        b = layer.bert_attn(h, bert_out.last, bert_out.mask)

        def by_hand(y):
            y = layer.self_res.after(x, y)
            return layer.ffn_res.after(y, layer.ffn(layer.ffn_res.before(y)))

        w = model.enc_drop_net.weights()
        assert w == (0.5, 0.5)
        torch.testing.assert_close(layer(x, batch.src_mask, bert_out.last, bert_out.mask, w), by_hand((a + b) / 2))
        torch.testing.assert_close(layer(x, batch.src_mask, bert_out.last, bert_out.mask, (1.0, 0.0)), by_hand(a))
        torch.testing.assert_close(layer(x, batch.src_mask, bert_out.last, bert_out.mask, (0.0, 1.0)), by_hand(b))


def test_training_forward_is_reproducible_with_a_fixed_seed(small_batch):
    """Two models built under the same seed draw the same drop-net branches: identical training logits."""
    outs = []
    for _ in range(2):
        model, _ = fused(seed=5, p_net=1.0)
        model.train()
        batch = with_inputs(model, small_batch)
        outs.append(torch.stack([model(batch).logits for _ in range(4)]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    # p_net = 1 draws single branches, so consecutive training forwards differ (no dropout in this config).
    assert not torch.equal(outs[0][0], outs[0][1]) or not torch.equal(outs[0][1], outs[0][2])


def test_bert_is_frozen_unless_fine_tuned():
    model, _ = fused()
    groups = model.parameter_groups()
    assert not any(p.requires_grad for p in groups["bert"])
    assert all(p.requires_grad for p in groups["nmt"])
    tuned, _ = fused(bert={**TINY_BERT, "freeze": False})
    assert all(p.requires_grad for p in tuned.parameter_groups()["bert"])
    assert len(groups["bert"]) + len(groups["nmt"]) == len(list(model.parameters()))


# ---------------------------------------------------------------------- warm start from the baseline
def baseline_checkpoint(tmp_path, checksum="v1", **model_fields):
    torch.manual_seed(1)
    cfg = ExperimentConfig.from_dict({"model": {"name": "transformer", **NO_DROPOUT, **model_fields}})
    base = build_model(cfg.model, VOCAB, PAD, BOS, EOS)
    path = save_checkpoint(tmp_path / "base.pt", {"model": base.state_dict(), "config": cfg.to_dict(),
                                                  "vocab": {"checksum": checksum}})
    return base, path


def test_warm_start_loads_the_baseline_and_leaves_bert_attention_fresh(tmp_path):
    base, path = baseline_checkpoint(tmp_path)
    model, cfg = fused(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = warm_start(model, path, cfg, SimpleNamespace(checksum="v1"))
    state = model.state_dict()
    for k, v in base.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    assert set(report.loaded) == set(base.state_dict())
    assert set(report.fresh) == set(state) - set(base.state_dict())
    assert all(".bert_attn." in k or k.startswith(("bert.", "enc_drop_net.", "dec_drop_net."))
               for k in report.fresh)
    assert any(".bert_attn." in k for k in report.fresh)
    for k in report.fresh:  # kept exactly as built (fresh init, pretrained BERT)
        torch.testing.assert_close(state[k], before[k], rtol=0, atol=0)


def test_warm_start_fails_loudly_on_vocabulary_or_dimension_mismatch(tmp_path):
    _, path = baseline_checkpoint(tmp_path)
    model, cfg = fused()
    with pytest.raises(CheckpointError, match="vocabulary"):
        warm_start(model, path, cfg, SimpleNamespace(checksum="other"))
    _, path = baseline_checkpoint(tmp_path, ffn_dim=128)
    with pytest.raises(CheckpointError, match=r"model.ffn_dim is 128 in the checkpoint but 64 here"):
        warm_start(model, path, cfg, SimpleNamespace(checksum="v1"))
    # Same config fields but a different vocabulary size: the embedding's shape is named.
    torch.manual_seed(1)
    bcfg = ExperimentConfig.from_dict({"model": {"name": "transformer", **NO_DROPOUT}})
    other = build_model(bcfg.model, VOCAB + 8, PAD, BOS, EOS)
    path = save_checkpoint(tmp_path / "v.pt", {"model": other.state_dict(), "config": bcfg.to_dict(),
                                               "vocab": {"checksum": "v1"}})
    with pytest.raises(CheckpointError, match=r"src_embed.weight has shape \(48, 32\) in the checkpoint"):
        warm_start(model, path, cfg, SimpleNamespace(checksum="v1"))


def test_translator_builds_the_bert_stream_of_raw_input(tmp_path):
    """``nmtcore translate`` on a BERT-fused checkpoint: raw lines get their own BERT stream, and the
    hypotheses equal those of the test split decoded at the end of training."""
    from pathlib import Path

    from nmtcore.data import prepare_data
    from nmtcore.decoding import load_translator
    from nmtcore.engine import run_experiment
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "train.max_epochs": 1,
                                       # live BERT both ways (the cache stores fp16 features: near-ties may flip)
                                       "model.bert.use_cache": False})
    summary = run_experiment(cfg)
    test = prepare_data(cfg.data).splits["test"]
    src = list(test.raw_src)  # the same batches as the end-of-training decode: exact equality
    translator = load_translator(Path(cfg.output_dir) / "checkpoints" / "epoch1.pt")
    expected = Path(summary.test["test"].hyp_path).read_text(encoding="utf-8").splitlines()
    assert translator.translate(src) == expected


def test_translator_decodes_a_cached_input_from_the_features_its_run_decoded_from(tmp_path):
    """With the feature cache on (frozen BERT), a run decodes its test set from float16 cached states. The same
    checkpoint translating that same text reads the same entry, so it gives the run's own hypotheses; text the
    cache has never seen is encoded live."""
    from pathlib import Path

    from nmtcore.data import prepare_data
    from nmtcore.decoding import load_translator
    from nmtcore.engine import run_experiment
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "train.max_epochs": 1})
    summary = run_experiment(cfg)
    src = list(prepare_data(cfg.data).splits["test"].raw_src)
    translator = load_translator(Path(cfg.output_dir) / "checkpoints" / "epoch1.pt")
    expected = Path(summary.test["test"].hyp_path).read_text(encoding="utf-8").splitlines()
    assert translator.translate(src) == expected
    assert len(translator.translate(src[:5])) == 5  # not cached as such: live states


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_skipped_branch_gets_a_zero_gradient_and_keeps_its_momentum_only_when_asked(small_batch, stack):
    """``model.drop_net_zero_grads``: the branch drop-net switched off gets zero gradients (the original code's
    ×0), so Adam moves it on its momentum; off (the default), it gets none and Adam leaves it where it was. The
    layer's output is the same either way."""
    outs, moved = {}, {}
    for zero in (False, True):
        model, _ = fused(p_net=1.0, drop_net_zero_grads=zero)
        model.train()
        batch = with_inputs(model, small_batch)
        bert_out = model.bert(batch)
        x = model.embed(batch.src, model.src_embed).detach()  # the layer's input: a leaf for both backward passes
        if stack == "encoder":
            layer = model.encoder_layers[0]
            run = lambda w: layer(x, batch.src_mask, bert_out.last, bert_out.mask, w)  # noqa: E731
            on, off = layer.self_attn, layer.bert_attn  # w = (1, 0): attn_S only
        else:
            layer = model.decoder_layers[0]
            enc = x
            y0 = model.embed(batch.tgt_in, model.tgt_embed).detach()
            run = lambda w: layer(y0, enc, batch.src_mask, bert_out.last, bert_out.mask, w)  # noqa: E731
            on, off = layer.bert_attn, layer.cross_attn  # w = (1, 0): attn_B only
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        run((0.5, 0.5)).square().mean().backward()  # a step through both: both get momentum
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in off.parameters()]
        out = run((1.0, 0.0))
        out.square().mean().backward()
        outs[zero] = out.detach()
        grads = [p.grad for p in off.parameters()]
        if zero:
            assert all(g is not None and not g.any() for g in grads)
        else:
            assert all(g is None for g in grads)
        assert all(p.grad is not None and p.grad.any() for p in on.parameters() if p.dim() > 1)
        opt.step()
        moved[zero] = any(not torch.equal(a, p) for a, p in zip(before, off.parameters()))
    torch.testing.assert_close(outs[True], outs[False])
    assert moved == {False: False, True: True}
