"""The diagnostics' probes of how a model divides its attention and what its auxiliary losses left: the tap of
``attend_parts`` (:mod:`nmtcore.nn.probes`), PLM-sponsored's and BERT-JAM's ``usage_probe``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nmtcore.config import ExperimentConfig
from nmtcore.models import build_model
from nmtcore.nn import attend_parts, causal_mask
from nmtcore.nn.probes import PartShares, tapping
from nmtcore.testing.tiny_bert import add_bert_stream, tiny_bert_dir
from nmtcore.testing.zoo import BOS, EOS, PAD, make_batch

VOCAB = 40
SRC = [[5, 6, 7, 8, 9], [10, 11]]
TGT = [[12, 13, 14], [15, 16, 17, 18, 19, 20]]


def parts_of(seed: int = 0, t_q: int = 4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, t_q, 8, generator=g)
    k1, v1 = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    k2, v2 = torch.randn(2, 3, t_q, 8, generator=g), torch.randn(2, 3, t_q, 8, generator=g)
    pad = torch.tensor([[True] * 5, [True, True, False, False, False]])[:, None, None, :]  # True = may attend
    return q, [(k1, v1, pad), (k2, v2, causal_mask(t_q, t_q, q.device))]


@pytest.mark.parametrize("t_q", [1, 4])
def test_the_tap_sees_each_parts_softmax_mass_and_changes_nothing(t_q):
    """The tap gets, per part, the summed probability of one softmax over all parts' scores; the output with a
    tap equals the output without one (both code paths: a sequence of queries and one decoding step)."""
    q, parts = parts_of(t_q=t_q)
    seen = []
    with torch.no_grad():
        plain = attend_parts(q, parts, 0.0)
        tapped = attend_parts(q, parts, 0.0, tap=seen.append)
    assert torch.allclose(plain, tapped, atol=1e-6)
    (k1, _, m1), (k2, _, m2) = parts
    scores = torch.cat([(q @ k1.transpose(-1, -2)).masked_fill(~m1, -math.inf),
                        (q @ k2.transpose(-1, -2)).masked_fill(~m2, -math.inf)], dim=-1) / math.sqrt(8)
    probs = scores.softmax(-1)
    assert len(seen) == 1 and len(seen[0]) == 2
    assert torch.allclose(seen[0][0], probs[..., :5].sum(-1), atol=1e-6)
    assert torch.allclose(seen[0][1], probs[..., 5:].sum(-1), atol=1e-6)


def test_part_shares_count_real_queries_only_and_refuse_a_misnamed_tap():
    shares = PartShares(("a", "b"))
    shares([torch.full((1, 2, 3), 0.25), torch.full((1, 2, 3), 0.75)])  # no queries set: ignored
    assert shares.shares("attention") == {}
    shares.set_queries(torch.tensor([[True, True, False]]))
    masses = torch.tensor([[[0.2, 0.4, 0.9]] * 2])  # (1, 2 heads, 3 queries); the padded query's 0.9 is left out
    shares([masses, 1 - masses])
    shares([torch.zeros(1, 2, 5), torch.ones(1, 2, 5)])  # another query length (a decoding step): ignored
    assert shares.shares("attention") == pytest.approx({"attention/a": 0.3, "attention/b": 0.7})
    with pytest.raises(ValueError, match="3 parts tapped, 2 named"):
        shares([masses] * 3)


def test_tapping_sets_and_clears_the_tap_even_when_the_block_fails():
    mods = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    shares = PartShares(("x", "y"))
    with pytest.raises(RuntimeError):
        with tapping(mods, shares):
            assert all(m.tap is shares for m in mods)
            raise RuntimeError
    assert all(m.tap is None for m in mods)


# ---------------------------------------------------------------------- PLM-sponsored
PLM = {"name": "plm_sponsored", "decoder_layers": 2, "d_model": 32, "ffn_dim": 64, "heads": 4,
       "bert": {"name": tiny_bert_dir(), "freeze": False}, "tgt_bert": {"name": tiny_bert_dir(), "freeze": False}}


def plm(**fields):
    torch.manual_seed(0)
    cfg = ExperimentConfig.from_dict({"model": {**PLM, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS).eval()


def probe(model, batch):
    with torch.no_grad(), model.usage_probe() as figures:
        model(batch)
    return figures


def test_plm_sponsored_attention_shares_follow_eq3s_mask_under_uniform_attention():
    """With the coordinator's queries zeroed every allowed key weighs the same, so a target position t of a
    sentence with S real WordPieces gives r_S S / (S + 2(t + 1)) (Eq. 3: the source, and r_T and r_{j−1} up to t);
    the figures average that over real positions, heads and layers, and the gate's g is 1/2 with W zeroed."""
    model = plm()
    for layer in model.coordinator:
        torch.nn.init.zeros_(layer.attn.q.weight)
        torch.nn.init.zeros_(layer.attn.q.bias)
    torch.nn.init.zeros_(model.encoder_gate.gate.weight)
    batch = add_bert_stream(make_batch(SRC, TGT), PAD)
    figures = probe(model, batch)
    expected = []
    for b in range(2):
        s = int((~batch.extras["bert_mask"][b]).sum())
        expected += [s / (s + 2 * (t + 1)) for t in range(int(batch.tgt_in[b].ne(PAD).sum()))]
    src = sum(expected) / len(expected)
    assert figures["attention/source"] == pytest.approx(src, rel=1e-5)
    assert figures["attention/target_bert"] == pytest.approx((1 - src) / 2, rel=1e-5)
    assert figures["attention/history"] == pytest.approx((1 - src) / 2, rel=1e-5)
    assert figures["source_gate/top"] == pytest.approx(0.5)


def test_plm_sponsored_distance_from_the_pretrained_bert_with_and_without_a_teacher():
    """Untrained, the top layer is the pretrained one (distance 0) and the half layer is the pretrained half
    layer; an arm without a teacher measures against the pretrained BERT loaded for the probe, with the same
    figures; moving the fine-tuned BERT's weights moves the distance."""
    with_teacher, without = plm(kd_teacher=True), plm(kd_teacher=False, mlm_loss=False, tgt_lm_loss=False)
    batch = add_bert_stream(make_batch(SRC, TGT), PAD)
    a, b = probe(with_teacher, batch), probe(without, batch)
    assert a["pretrained_mse/top"] == pytest.approx(0.0, abs=1e-10)
    assert a["pretrained_mse/half"] == pytest.approx(a["pretrained_mse/own_half"]) and a["pretrained_mse/half"] > 0
    assert {k: v for k, v in b.items() if k.startswith("pretrained_mse/")} == pytest.approx(
        {k: v for k, v in a.items() if k.startswith("pretrained_mse/")})
    assert "mlm/acc" in a and "mlm/acc" not in b  # the MLM head exists with L_MLM only
    # A teacher stopping below the top layer (model.kd_teacher_layer) is not the pretrained BERT the figures
    # measure against: the probe loads the whole one, as for an arm without a teacher.
    lower = probe(plm(kd_teacher=True, kd_teacher_layer=1), batch)
    assert {k: v for k, v in lower.items() if k.startswith("pretrained_mse/")} == pytest.approx(
        {k: v for k, v in a.items() if k.startswith("pretrained_mse/")})
    with torch.no_grad():
        for p in without.bert.bert.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = probe(without, batch)
    assert moved["pretrained_mse/top"] > 1e-4 and moved["pretrained_mse/own_half"] == pytest.approx(
        b["pretrained_mse/own_half"])


def test_plm_sponsored_target_lm_figures_are_the_decoders_next_token_guesses():
    """``target_lm/acc`` and ``target_lm/nll`` (bits) over every real target position, counted one sentence
    at a time; the MLM accuracy is a share."""
    model = plm()
    batch = add_bert_stream(make_batch(SRC, TGT), PAD)
    figures = probe(model, batch)
    hits = n = 0
    bits = 0.0
    with torch.no_grad():
        for b in range(2):
            length = int(batch.tgt_out[b].ne(PAD).sum())
            states = model.decoder(batch.tgt_in[b:b + 1, :length])[0]  # this sentence alone
            logp = F.log_softmax(states @ model.decoder.word.weight.T, dim=-1)
            gold = batch.tgt_out[b, :length]
            hits += int(logp.argmax(-1).eq(gold).sum())
            bits -= float(logp.gather(1, gold[:, None]).sum()) / math.log(2)
            n += length
    assert figures["target_lm/acc"] == pytest.approx(hits / n)
    assert figures["target_lm/nll"] == pytest.approx(bits / n, rel=1e-4)
    assert 0 <= figures["mlm/acc"] <= 1


# ---------------------------------------------------------------------- BERT-JAM
def test_bert_jam_attention_shares_follow_the_masks_under_uniform_attention():
    """Queries zeroed: the encoder's joint attention gives BERT M / (S + M) of each real source position (M real
    WordPieces, S real tokens); the decoder's BERT attention M / (M + t + 1), its encoder attention
    S / (S + t + 1) at target position t."""
    torch.manual_seed(0)
    cfg = ExperimentConfig.from_dict({"model": {"name": "bert_jam", "encoder_layers": 2, "decoder_layers": 2,
                                                "d_model": 32, "ffn_dim": 64, "heads": 4,
                                                "bert": {"name": tiny_bert_dir()}}})
    model = build_model(cfg.model, VOCAB, PAD, BOS, EOS).eval()
    d = cfg.model.d_model
    for layer in model.encoder_layers:
        torch.nn.init.zeros_(layer.self_attn.qkv.weight[:d])
        torch.nn.init.zeros_(layer.self_attn.qkv.bias[:d])
    for layer in model.decoder_layers:
        for attn in (layer.bert_attn, layer.enc_attn):
            torch.nn.init.zeros_(attn.qkv.weight[:d])
            torch.nn.init.zeros_(attn.qkv.bias[:d])
    batch = add_bert_stream(make_batch(SRC, TGT), PAD)
    figures = probe(model, batch)
    enc, dec_bert, dec_enc = [], [], []
    for b in range(2):
        m, s = int((~batch.extras["bert_mask"][b]).sum()), int((~batch.src_mask[b]).sum())
        enc += [m / (s + m)] * s
        for t in range(int(batch.tgt_in[b].ne(PAD).sum())):
            dec_bert.append(m / (m + t + 1))
            dec_enc.append(s / (s + t + 1))
    assert figures == pytest.approx({"attention/enc/bert": sum(enc) / len(enc),
                                     "attention/dec/bert": sum(dec_bert) / len(dec_bert),
                                     "attention/dec/encoder": sum(dec_enc) / len(dec_enc)}, rel=1e-5)


def test_a_trained_plm_sponsored_run_logs_the_probes_figures(tmp_path):
    """Through the trainer: ``measure`` (what a trial logs after training) carries every figure of the probe for
    an arm with all of Eq. 9's terms."""
    from nmtcore.diagnostics import measure
    from nmtcore.engine import build_trainer
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "plm_sponsored", "model.bert.name": tiny_bert_dir(),
                                       "model.bert.freeze": False, "model.tgt_bert.name": tiny_bert_dir(),
                                       "model.d_model": 32, "model.ffn_dim": 64, "train.kd_alpha": 0.9,
                                       "train.max_epochs": 1, "train.num_threads": 1})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    trainer.fit()
    torch.set_num_threads(2)
    figures = measure(trainer)
    probes = {k for k in figures if k.startswith("probe/")}
    assert probes == {f"probe/{k}" for k in ("attention/source", "attention/target_bert", "attention/history",
                                              "source_gate/top", "pretrained_mse/half", "pretrained_mse/top",
                                              "pretrained_mse/own_half", "mlm/acc", "target_lm/acc", "target_lm/nll")}
    assert sum(figures[f"probe/attention/{k}"] for k in ("source", "target_bert", "history")) == pytest.approx(1.0)
    assert figures["probe/pretrained_mse/top"] > 0  # one epoch of fine-tuning moved the source BERT
