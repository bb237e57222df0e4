"""PLM-sponsored NMT (seed 001): the paper's identities on tiny models.

Coordinator mask (Eq. 3), the half-layer gate (Eq. 6) by hand, half-layer KD (Eq. 4-5: its gradient reaches
the student's lower half and never the teacher) and the loss combination of Eq. 9, the PLMs' dropout, the
causal target BERT against ``transformers``' BertModel, MLM corruption, and FWET (Algorithm 1) by hand. Cached vs
uncached decoding and the rest of the model interface are the contract suite's
(``tests/test_model_contract.py -k plm``).
"""

from __future__ import annotations

import math

import pytest
import torch

from nmtcore.bert.mlm import mlm_corrupt
from nmtcore.config import ConfigError, ExperimentConfig, TrainConfig
from nmtcore.engine.losses import check_kd, kd_mse, label_smoothed_nll, training_loss
from nmtcore.models import build_model
from nmtcore.models.fwet import (
    build_fwet,
    fwet_counts,
    fwet_matrix,
    fwet_softmax,
    wordpiece_spelling,
)
from nmtcore.models.plm_sponsored import CoordinatorAttention, HalfLayerGate
from nmtcore.testing.tiny_bert import BERT_HIDDEN, add_bert_stream, tiny_bert_dir
from nmtcore.testing.zoo import BOS, EOS, PAD, make_batch

VOCAB = 40
TINY = {"name": "plm_sponsored", "encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "ffn_dim": 64,
        "heads": 4, "dropout": 0.1, "bert": {"name": tiny_bert_dir(), "freeze": False},
        "tgt_bert": {"name": tiny_bert_dir(), "freeze": False}}


def tiny(seed: int = 0, **fields):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {**TINY, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


def batch_of(src, tgt):
    return add_bert_stream(make_batch(src, tgt), PAD)


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("fields, key", [
    ({"kd_layer": "top"}, "model.kd_layer"),
    ({"mlm_prob": 0.0}, "model.mlm_prob"),
    ({"tgt_lm_fraction": 1.5}, "model.tgt_lm_fraction"),
    ({"pre_norm": True}, "model.pre_norm"),
    ({"bert": {"name": tiny_bert_dir()}}, "model.bert.freeze"),  # frozen encoder but MLM / KD asked for
    ({"tgt_bert": {"name": ""}}, "model.tgt_bert.name"),
])
def test_config_ranges_fail_naming_the_key(fields, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        ExperimentConfig.from_dict({"model": {**TINY, **fields}})


def test_defaults_are_the_papers():
    cfg = ExperimentConfig.from_dict({"model": {"name": "plm_sponsored"}}).model
    assert (cfg.kd_layer, cfg.mlm_loss, cfg.tgt_lm_loss, cfg.tgt_lm_fraction, cfg.encoder_gate) == (
        "half", True, True, 0.1, True)
    assert cfg.bert.name == "minilm" and not cfg.bert.freeze
    assert cfg.tgt_bert.name == "e5:L6" and not cfg.tgt_bert.freeze  # German-capable, pretrained
    assert cfg.plm_dropout < 0  # each BERT's own rate unless a preset (the paper's) sets one
    with pytest.raises(ConfigError, match=r"^model.plm_dropout: must be in \[0, 1\)"):
        ExperimentConfig.from_dict({"model": {**TINY, "plm_dropout": 1.0}})


def test_the_papers_presets_carry_its_coordinator_depth_dropout_and_alpha():
    """Section 3.2-3.3 and 4 of the paper: coordinator = Transformer-base, 12 layers (6 in the En-De ablation),
    PLM dropout 0.5 on IWSLT'14 (0.3 on WMT'14), α = 0.9 (Eq. 5)."""
    from nmtcore.config import preset

    iwslt, ablation = preset("plm_sponsored_iwslt_paper"), preset("plm_sponsored_ablation_paper")
    for cfg, layers, dropout in ((iwslt, 12, 0.5), (ablation, 6, 0.3)):
        m = cfg.model
        assert m.name == "plm_sponsored" and m.decoder_layers == layers and m.plm_dropout == dropout
        assert (m.d_model, m.ffn_dim, m.heads) == (512, 2048, 8)  # Transformer-base
        assert cfg.train.kd_alpha == 0.9 and not m.bert.freeze and not m.tgt_bert.freeze
    assert (iwslt.data.src_lang, iwslt.data.tgt_lang, iwslt.train.max_updates) == ("de", "en", 100000)
    assert (ablation.data.src_lang, ablation.data.tgt_lang, ablation.train.max_updates) == ("en", "de", 400000)


def test_plm_dropout_is_the_hidden_dropout_of_both_plms():
    model = tiny(plm_dropout=0.5)
    drops = {n: m.p for n, m in model.bert.bert.named_modules() if isinstance(m, torch.nn.Dropout)}
    hidden = {n: p for n, p in drops.items() if not n.endswith("attention.self.dropout")}
    assert hidden and set(hidden.values()) == {0.5}  # embeddings, attention output, FFN output
    assert {p for n, p in drops.items() if n.endswith("attention.self.dropout")} == {0.1}  # the BERT's own
    dec = model.decoder
    assert dec.dropout == 0.5 and all(layer.self_res.dropout == layer.ffn_res.dropout == 0.5 for layer in dec.layers)
    own = tiny()
    assert own.decoder.dropout == 0.1 and {m.p for m in own.bert.bert.modules()
                                           if isinstance(m, torch.nn.Dropout)} == {0.1}


# ---------------------------------------------------------------------- coordinator mask (Eq. 3)
def test_coordinator_attention_sees_all_source_and_only_past_targets():
    torch.manual_seed(0)
    attn = CoordinatorAttention(16, 4, 0.0).eval()
    g = torch.Generator().manual_seed(1)
    x, r_t = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)  # r_{j-1}, r_T
    r_s = torch.randn(2, 4, 16, generator=g)
    src_mask = torch.tensor([[False] * 4, [False, False, False, True]])  # row 1: last source position is pad
    ref = attn(x, r_s, src_mask, r_t)
    t = 2
    for which in ("x", "r_t"):  # perturb positions > t of r_{j-1} or of r_T: outputs ≤ t must not move
        xx, rt = x.clone(), r_t.clone()
        (xx if which == "x" else rt)[:, t + 1:] += 10.0
        out = attn(xx, r_s, src_mask, rt)
        torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1])
        assert not torch.allclose(out[:, t + 1:], ref[:, t + 1:])
    # Every (non-pad) source position is visible from every target position, the first included.
    rs = r_s.clone()
    rs[:, 3] += 10.0
    out = attn(x, rs, src_mask, r_t)
    assert (out[0] - ref[0]).abs().amax(-1).min() > 1e-4  # row 0: every position changed
    torch.testing.assert_close(out[1], ref[1])  # row 1: position 3 is padding, masked (M_S excludes pad)


def test_model_outputs_at_t_ignore_future_target_tokens_but_see_the_whole_source():
    model = tiny().eval()
    src, tgt = [[5, 6, 7, 8]], [[9, 10, 11, 12, 13]]
    ref = model(batch_of(src, tgt)).logits[0]  # (T, V)
    t = 2
    future = [tgt[0][:t] + [30, 31, 32]]  # tgt_in = [bos] + tgt: positions > t change
    out = model(batch_of(src, future)).logits[0]
    torch.testing.assert_close(out[: t + 1], ref[: t + 1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out[t + 1:], ref[t + 1:])
    last_src = model(batch_of([[5, 6, 7, 20]], tgt)).logits[0]  # the last source word changes
    assert (last_src[0] - ref[0]).abs().max() > 1e-4  # position 0 already sees it


# ---------------------------------------------------------------------- target BERT = BERT, causally
def test_causal_target_bert_is_the_target_bert():
    """With the NMT word table set to BERT's WordPiece table, the decoder is the BERT: equal at position 0
    (where causal and bidirectional attention coincide) and for a one-token input."""
    from transformers import BertModel

    model = tiny().eval()
    hf = BertModel.from_pretrained(tiny_bert_dir(), add_pooling_layer=False).eval()
    with torch.no_grad():
        model.decoder.word.weight.copy_(hf.get_input_embeddings().weight)  # both vocabularies have 40 ids
        ids = torch.tensor([[7, 12, 9, 30]])
        ours = model.decoder(ids)  # causal: position 0 sees only itself
        theirs = hf(input_ids=ids[:, :1]).last_hidden_state  # a one-token input, bidirectional = causal
        torch.testing.assert_close(ours[:, :1], theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.decoder(ids[:, :1]), theirs, atol=1e-5, rtol=1e-5)
    assert model.decoder.hidden_size == BERT_HIDDEN


# ---------------------------------------------------------------------- KD (Eq. 4-5) and Eq. 9
def _train_mode_without_bert_dropout(model):
    model.train()
    model.bert.bert.eval()  # the student BERT's own dropout off: only then can it equal the teacher
    return model


def test_kd_is_zero_when_the_student_is_the_teacher():
    batch = batch_of([[5, 6, 7], [8, 9, 10, 11]], [[12, 13], [14, 15, 16]])
    full = _train_mode_without_bert_dropout(tiny(kd_layer="full"))
    ex = full(batch)
    assert torch.equal(ex.kd.mask, batch.extras["bert_mask"])
    assert kd_mse(ex.kd.student, ex.kd.teacher, ex.kd.mask).item() == pytest.approx(0.0, abs=1e-10)
    # Eq. 4's student is layer M/2: at init it differs from the teacher's last layer.
    half = _train_mode_without_bert_dropout(tiny(kd_layer="half"))
    ex = half(batch)
    assert kd_mse(ex.kd.student, ex.kd.teacher, ex.kd.mask).item() > 1e-6  # (a random tiny BERT: small)
    assert not any(p.requires_grad for p in half.teacher.parameters())


def test_kd_teacher_layer_is_the_pretrained_bert_s_layer_k():
    """``model.kd_teacher_layer`` = k: r_plm is the pretrained BERT's layer k (the teacher keeps its bottom k
    layers), so the student's untrained half layer (layer 1 of the tiny BERT's 2) equals a layer-1 teacher;
    0 and the BERT's depth are the paper's last layer; a layer the BERT lacks is refused naming the key."""
    from transformers import BertModel

    batch = batch_of([[5, 6, 7], [8, 9, 10, 11]], [[12, 13], [14, 15, 16]])
    model = _train_mode_without_bert_dropout(tiny(kd_teacher_layer=1))
    assert model.half_layer == 1 and model.teacher.layers == 1 and len(model.teacher.bert.encoder.layer) == 1
    ex = model(batch)
    assert kd_mse(ex.kd.student, ex.kd.teacher, ex.kd.mask).item() == pytest.approx(0.0, abs=1e-10)
    hf = BertModel.from_pretrained(tiny_bert_dir(), add_pooling_layer=False).eval()
    real = ~batch.extras["bert_mask"]
    with torch.no_grad():
        states = hf(input_ids=batch.extras["bert_ids"], attention_mask=real.long(),
                    token_type_ids=batch.extras["bert_segments"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(ex.kd.teacher[real], states[1][real], atol=1e-5, rtol=1e-5)
    for k in (0, 2):  # the last layer, named or by default
        teacher = tiny(kd_teacher_layer=k).teacher
        assert teacher.layers == 2 and len(teacher.bert.encoder.layer) == 2
    with pytest.raises(ConfigError, match="^model.kd_teacher_layer: .*2 layers"):
        tiny(kd_teacher_layer=3)
    with pytest.raises(ConfigError, match="^model.kd_teacher_layer: "):
        ExperimentConfig.from_dict({"model": {**TINY, "kd_teacher_layer": -1}})


def test_kd_gradients_reach_the_student_only():
    """With α = 0 the loss is L_KD alone (Eq. 5): every student layer up to M/2 gets a non-zero gradient,
    the layers above M/2 and the coordinator exactly zero (h_{M/2} does not depend on them), the teacher
    none at all (frozen, its target detached). With α = 0.9 the student's gradient is exactly
    0.9·∇L_NMT + 0.1·∇L_KD, and an update moves the student while the teacher stays the initial copy."""
    model = _train_mode_without_bert_dropout(tiny(mlm_loss=False, tgt_lm_loss=False, dropout=0.0))
    batch = batch_of([[5, 6, 7], [8, 9]], [[12, 13], [14, 15, 16]])
    out = model(batch)
    assert out.kd.teacher.grad_fn is None and not out.kd.teacher.requires_grad  # r_plm: a fixed target
    lo = training_loss(out, batch.tgt_out, TrainConfig(kd_alpha=0.0), PAD)
    lo.loss.backward()
    layers = model.bert.bert.encoder.layer
    half = model.half_layer
    assert 1 <= half < len(layers)
    for i, layer in enumerate(layers):
        grads = [p.grad for p in layer.parameters()]
        if i < half:
            assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0, i
        else:
            assert all(g is None or torch.count_nonzero(g) == 0 for g in grads), i
    assert model.bert.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.coordinator.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.teacher.parameters())

    # Eq. 5 with α = 0.9: the gradient is the weighted sum of the two terms' gradients (one forward).
    model.zero_grad(set_to_none=True)
    out = model(batch)
    params = [p for p in model.bert.bert.parameters()]
    nmt = label_smoothed_nll(out.logits, batch.tgt_out, 0.1, PAD)
    kd = kd_mse(out.kd.student, out.kd.teacher, out.kd.mask) * nmt.n_tokens  # summed like the NMT loss
    g_nmt = torch.autograd.grad(nmt.loss, params, retain_graph=True, allow_unused=True)
    g_kd = torch.autograd.grad(kd, params, retain_graph=True, allow_unused=True)
    g = torch.autograd.grad(training_loss(out, batch.tgt_out, TrainConfig(kd_alpha=0.9), PAD).loss, params,
                            allow_unused=True)
    zero = torch.zeros(())
    for a, b_, c in zip(g, g_nmt, g_kd):
        want = 0.9 * (b_ if b_ is not None else zero) + 0.1 * (c if c is not None else zero)
        torch.testing.assert_close(a if a is not None else zero.expand_as(want), want, rtol=1e-4, atol=1e-7)
    teacher0 = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    student0 = layers[0].attention.self.query.weight.detach().clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    training_loss(model(batch), batch.tgt_out, TrainConfig(kd_alpha=0.9), PAD).loss.backward()
    opt.step()
    assert not torch.equal(layers[0].attention.self.query.weight, student0)
    assert all(torch.equal(v, teacher0[k]) for k, v in model.teacher.state_dict().items())


def test_eq6_half_layer_gate_by_hand():
    """Eq. 6 element by element: g = σ([h_M ; h_{M/2}] W), h_S = g·h_M + (1 − g)·h_{M/2},
    r_S = LN(FFN(h_S) + h_S); and the model's encoder output is r_S of BERT's layers M and M/2."""
    torch.manual_seed(0)
    gate = HalfLayerGate(6, 10, "gelu", 0.0, 0.0).eval()
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_()  # off the init (LayerNorm γ, β included)
    top, half = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    W = gate.gate.weight.detach().T  # (2H, H)
    fc1, fc2, ln = gate.ffn.fc1, gate.ffn.fc2, gate.ffn_res.norm
    want = torch.zeros(2, 3, 6)
    for b in range(2):
        for t in range(3):
            x = torch.cat([top[b, t], half[b, t]])  # [h_M ; h_{M/2}]  (2H,)
            g = 1.0 / (1.0 + torch.exp(-(x @ W)))
            h = g * top[b, t] + (1 - g) * half[b, t]
            u = h @ fc1.weight.T + fc1.bias
            ffn = (0.5 * u * (1 + torch.erf(u / math.sqrt(2)))) @ fc2.weight.T + fc2.bias  # GELU
            z = ffn + h
            z = (z - z.mean()) / torch.sqrt(z.var(unbiased=False) + ln.eps)
            want[b, t] = z * ln.weight + ln.bias
    with torch.no_grad():
        torch.testing.assert_close(gate(top, half), want, rtol=1e-5, atol=1e-5)
    model = tiny().eval()
    batch = batch_of([[5, 6, 7], [8, 9]], [[12, 13], [14]])
    x = batch.extras
    with torch.no_grad():
        hs = model.bert.bert(input_ids=x["bert_ids"], attention_mask=(~x["bert_mask"]).long(),
                             token_type_ids=x["bert_segments"], output_hidden_states=True).hidden_states
        m = len(hs) - 1
        want = model.src_proj(model.encoder_gate(hs[m], hs[m // 2]))  # h_M and h_{M/2} of the source BERT
        torch.testing.assert_close(model.encode(batch).out, want)


def test_alpha_one_without_aux_losses_is_plain_nmt_loss():
    batch = batch_of([[5, 6, 7], [8, 9]], [[12, 13, 14], [15]])
    model = tiny(mlm_loss=False, tgt_lm_loss=False).train()
    out = model(batch)
    assert out.kd is not None  # the teacher is there, idle at α = 1
    plain = label_smoothed_nll(out.logits, batch.tgt_out, 0.1, PAD)
    lo = training_loss(out, batch.tgt_out, TrainConfig(kd_alpha=1.0), PAD)
    assert lo.loss.item() == plain.loss.item() and lo.kd is None


def test_eq9_adds_mlm_and_lm_to_the_kd_combination():
    torch.manual_seed(3)
    batch = batch_of([[5, 6, 7, 8, 9, 10], [8, 9, 11]], [[12, 13, 14, 15, 16, 17, 18, 19], [15, 16]])
    model = tiny(tgt_lm_fraction=1.0).train()
    out = model(batch)
    ex = out
    assert ex.mlm_loss.ndim == 0 and ex.target_lm_loss.ndim == 0 and ex.target_lm_loss.item() > 0
    plain = label_smoothed_nll(out.logits, batch.tgt_out, 0.1, PAD)
    kd = kd_mse(ex.kd.student, ex.kd.teacher, ex.kd.mask)
    lo = training_loss(out, batch.tgt_out, TrainConfig(kd_alpha=0.9), PAD)
    n = plain.n_tokens
    want = 0.9 * plain.loss + 0.1 * kd * n + (ex.mlm_loss + ex.target_lm_loss) * n  # Eq. 9, per-token means
    assert (lo.loss / n).item() == pytest.approx((want / n).item(), rel=1e-6)
    assert lo.nll.item() == plain.nll.item()
    # Eq. 8 by hand: L_T over every target position (fraction 1) from the decoder alone (no source), through
    # the tied target table. Submodules in eval mode (no dropout); the top module's flag asks for the extras.
    model.eval()
    model.training = True
    keep = batch.tgt_out.ne(PAD)
    with torch.no_grad():
        r_t = model.decoder(batch.tgt_in)
        by_hand = torch.nn.functional.cross_entropy(r_t[keep] @ model.decoder.word.weight.T, batch.tgt_out[keep])
        got = model(batch).target_lm_loss
    assert got.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_eval_forward_returns_no_training_losses():
    model = tiny().eval()
    out = model(batch_of([[5, 6]], [[7]]))
    assert out.kd is None and out.mlm_loss is None and out.target_lm_loss is None


def test_check_kd_allows_an_idle_teacher_and_refuses_kd_without_one():
    with_teacher, without = tiny(), tiny(kd_teacher=False, mlm_loss=False)
    check_kd(TrainConfig(kd_alpha=1.0), with_teacher)
    check_kd(TrainConfig(kd_alpha=0.9), with_teacher)
    check_kd(TrainConfig(kd_alpha=1.0), without)
    with pytest.raises(ConfigError, match="^train.kd_alpha: 0.9 < 1 needs the model's KD teacher: set model.kd_"):
        check_kd(TrainConfig(kd_alpha=0.9), without)
    groups = with_teacher.parameter_groups()
    assert set(groups) == {"bert", "tgt_bert", "kd_teacher", "nmt"}
    assert sum(len(v) for v in groups.values()) == len(list(with_teacher.parameters()))


# ---------------------------------------------------------------------- MLM corruption
def test_mlm_corruption_never_touches_specials_and_follows_80_10_10():
    torch.manual_seed(0)
    ids = torch.randint(5, 40, (64, 50))
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = special[:, -1] = True
    special[:, 40:] = True  # padding
    out, selected = mlm_corrupt(ids, special, mask_id=4, vocab_size=40, prob=0.15, at_least_one=False)
    assert not (selected & special).any() and torch.equal(out[~selected], ids[~selected])
    frac = selected.float().sum() / (~special).float().sum()
    assert 0.12 < frac < 0.18
    masked = (out[selected] == 4).float().mean()
    kept = (out[selected] == ids[selected]).float().mean()
    assert 0.75 < masked < 0.85 and 0.07 < kept < 0.15


# ---------------------------------------------------------------------- FWET (Algorithm 1)
def test_fwet_by_hand_on_two_sentences():
    corpus = [
        # S1: "the" matches at the front, "run" at the back; left: NMT [dog, ##s] vs PLM [dogs], w = 1/2.
        (["the", "dog", "##s", "run"], ["the", "dogs", "run"]),
        # S2: "a", "dog" match at the front; then neither end matches: NMT [barks] vs PLM [bark, ##s], w = 2/1.
        (["a", "dog", "barks"], ["a", "dog", "bark", "##s"]),
    ]
    dic = fwet_counts(corpus)
    assert dic == {"the": {"the": 1.0}, "run": {"run": 1.0}, "a": {"a": 1.0},
                   "dog": {"dogs": 0.5, "dog": 1.0}, "##s": {"dogs": 0.5}, "barks": {"bark": 2.0, "##s": 2.0}}
    w = fwet_softmax(dic)
    e = math.exp
    assert w["dog"]["dog"] == pytest.approx(e(1.0) / (e(1.0) + e(0.5)))  # = 0.6225
    assert w["dog"]["dogs"] == pytest.approx(e(0.5) / (e(1.0) + e(0.5)))  # = 0.3775
    assert w["barks"] == {"bark": pytest.approx(0.5), "##s": pytest.approx(0.5)} and w["##s"] == {"dogs": 1.0}
    # Line 27 with one-hot PLM embeddings: each NMT row is its weight vector; unseen NMT ids keep their init.
    plm_vocab = ["the", "dogs", "run", "a", "dog", "bark", "##s"]
    nmt_vocab = ["the", "dog", "##s", "run", "a", "barks", "unseen"]
    by_id = {nmt_vocab.index(n): {plm_vocab.index(p): v for p, v in row.items()} for n, row in w.items()}
    init = torch.full((len(nmt_vocab), len(plm_vocab)), 7.0)
    table = fwet_matrix(by_id, torch.eye(len(plm_vocab)), init)
    torch.testing.assert_close(table[1], torch.tensor([0, 0.3775407, 0, 0, 0.6224593, 0, 0]))
    torch.testing.assert_close(table[5], torch.tensor([0, 0, 0, 0, 0, 0.5, 0.5]))
    torch.testing.assert_close(table[0], torch.eye(7)[0])
    torch.testing.assert_close(table[6], init[6])


def test_fwet_fully_matched_sentence_adds_no_cooccurrence():
    assert fwet_counts([(["a", "b"], ["a", "b"])]) == {"a": {"a": 1.0}, "b": {"b": 1.0}}
    assert fwet_counts([(["x"], ["y", "z"])]) == {"x": {"y": 2.0, "z": 2.0}}


def test_sentencepiece_pieces_in_wordpiece_spelling():
    assert wordpiece_spelling("\u2581Hund", str.lower) == "hund"
    assert wordpiece_spelling("e") == "##e"
    assert wordpiece_spelling("\u2581") == "\u2581"


def test_build_fwet_is_cached_and_initialises_the_decoder(tmp_path, monkeypatch):
    from nmtcore.config import BertConfig
    from nmtcore.data import SubwordVocab
    from nmtcore.models import fwet

    lines = ["two dogs run !", "the man is a dog", "a dog run", "the dogs run ?"] * 10
    text = tmp_path / "train.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    vocab = SubwordVocab.train_or_load([text], 40, tmp_path / "vocab")
    bert = BertConfig(name=tiny_bert_dir())
    calls = []
    real = fwet.fwet_from_corpus
    monkeypatch.setattr(fwet, "fwet_from_corpus", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = build_fwet(vocab, bert, lines, tmp_path / "cache")
    assert build_fwet(vocab, bert, lines, tmp_path / "cache") == path and len(calls) == 1
    payload = torch.load(path, weights_only=True)
    table = payload["embeddings"]
    assert table.shape == (len(vocab), BERT_HIDDEN) and payload["covered"] > 4
    # "▁dogs" matches the WordPiece "dogs" whenever it is peeled off an end: its row leans on that embedding.
    from transformers import BertModel

    plm = BertModel.from_pretrained(tiny_bert_dir(), add_pooling_layer=False).get_input_embeddings().weight
    dogs_nmt = vocab.sp.piece_to_id("\u2581dogs")
    assert dogs_nmt != vocab.sp.unk_id() and len(vocab) == VOCAB
    dogs_plm = 5 + ["zwei", "hunde", ",", "1", "000", "don", "##au", "##dampf", "##schiff", "##e", "lauf", "##en",
                    ".", "two", "dogs"].index("dogs")  # nmtcore.testing.tiny_bert.WORDPIECES after the 5 specials
    torch.testing.assert_close(table[dogs_nmt], plm[dogs_plm].detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(table[vocab.bos_id], plm[2].detach())  # bos = [CLS]
    model = tiny(fwet=str(path))
    torch.testing.assert_close(model.decoder.word.weight.detach(), table)
    with pytest.raises(ConfigError, match="^model.fwet: .* does not exist"):
        tiny(fwet=str(tmp_path / "missing.pt"))
    with pytest.raises(ConfigError, match="^model.fwet: .* holds a"):
        torch.manual_seed(0)
        cfg = ExperimentConfig.from_dict({"model": {**TINY, "fwet": str(path)}})
        build_model(cfg.model, len(vocab) + 1, PAD, BOS, EOS)


# ---------------------------------------------------------------------- through the trainer
def test_trains_and_decodes_through_the_platform(tmp_path):
    """The model-agnostic trainer runs Eq. 9 (KD + MLM + L_T through training_loss) with an FWET table
    built from the training targets; beam search decodes with the cached decoder."""
    from nmtcore.config import DecodeConfig
    from nmtcore.decoding.beam_search import beam_search
    from nmtcore.engine import build_trainer, setup_torch
    from nmtcore.models.fwet import prepare_fwet
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "plm_sponsored", "model.bert.name": tiny_bert_dir(),
                                       "model.bert.freeze": False, "model.tgt_bert.name": tiny_bert_dir(),
                                       "model.d_model": 32, "model.ffn_dim": 64, "train.kd_alpha": 0.9,
                                       "train.num_threads": 1, "data.max_tokens": 200})
    setup_torch(cfg)
    trainer = build_trainer(cfg, device=torch.device("cpu"))  # target BERT ready, FWET built (prepare)
    cfg, data, model = trainer.cfg, trainer.data, trainer.model
    assert cfg.model.fwet and prepare_fwet(cfg, data) is cfg
    # Its source is the WordPiece stream: the token budget counts it (a batch's stream stays within budget).
    every = list(trainer.train_batches(1))
    assert model.source_is_bert_stream and sum(b.size for b in every) == len(data.splits["train"].src)
    assert all(b.size == 1 or b.extras["bert_ids"].numel() <= cfg.data.max_tokens for b in every)
    batches = iter(every)
    stats = [trainer.train_step([next(batches)]) for _ in range(3)]
    torch.set_num_threads(2)
    assert all(math.isfinite(s["loss_sum"]) for s in stats)
    batch = trainer.collate(data.splits["valid"], list(range(4)))
    out = model.train()(batch)  # a real batch's WordPiece stream feeds KD and MLM
    assert out.kd is not None and out.mlm_loss is not None and out.target_lm_loss is not None
    assert out.kd.student.shape == out.kd.teacher.shape and torch.isfinite(out.mlm_loss)
    hyps = beam_search(model, batch, DecodeConfig(beam=3))
    assert len(hyps) == 4 and all(len(h) >= 1 for h in hyps)


def test_activation_checkpointing_changes_speed_and_memory_not_the_updates(tmp_path):
    """Checkpointing both fine-tuned BERTs (Eq. 9 with KD, MLM and L_T, dropout live) or not trains the same
    model: a speed-only setting (nmtcore.config.SPEED_ONLY_KEYS), so a resumed sweep may switch it off and reuse
    keys leave it out."""
    from nmtcore.config import SPEED_ONLY_KEYS
    from nmtcore.engine import build_trainer, setup_torch
    from nmtcore.testing.synthetic import tiny_experiment

    assert {"model.bert.activation_checkpointing", "model.tgt_bert.activation_checkpointing"} <= set(SPEED_ONLY_KEYS)
    weights = []
    for on in (True, False):
        cfg = tiny_experiment(tmp_path / str(on), **{
            "model.name": "plm_sponsored", "model.bert.name": tiny_bert_dir(), "model.bert.freeze": False,
            "model.tgt_bert.name": tiny_bert_dir(), "model.d_model": 32, "model.ffn_dim": 64, "train.kd_alpha": 0.9,
            "train.num_threads": 1, "data.max_tokens": 200, "model.bert.activation_checkpointing": on,
            "model.tgt_bert.activation_checkpointing": on})
        setup_torch(cfg)
        trainer = build_trainer(cfg, device=torch.device("cpu"))
        assert (trainer.model.bert.checkpointed_layers > 0) == on
        batches = iter(list(trainer.train_batches(1)))
        for _ in range(3):
            trainer.train_step([next(batches)])
        weights.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    torch.set_num_threads(2)
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-6, msg=k)
