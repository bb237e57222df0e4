"""Mask-fusion identities (seed 004): the GLU over BERT layers (Eq. 1-2), the mask knowledge matrix (Eq. 3-6:
θ = 0 masks nothing, θ = 1 everything, scores scaled by √d unless d is asked for, w1/b learning through a
straight-through estimator or frozen), the mask selecting by content on real Multi30k batches, the masked
fraction the trainer reports, the adaptive fusion (Eq. 7-9), the ablations M1-M3 (Table 4) differing from
M0 only where documented, θ validation, and the warm start from a baseline."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from nmtcore.bert import pool_to_tokens
from nmtcore.checkpoint import save_checkpoint
from nmtcore.config import MASK_FUSION_ABLATIONS as ABLATIONS
from nmtcore.config import (
    MODEL_CONFIGS,
    BertConfig,
    ConfigError,
    ExperimentConfig,
    MaskFusionConfig,
)
from nmtcore.engine import build_trainer, warm_start
from nmtcore.engine.losses import label_smoothed_nll
from nmtcore.engine.phases import parameter_groups
from nmtcore.models import build_model, model_class
from nmtcore.models.mask_fusion import AdaptiveFusion, LayerFusion, MaskKnowledge
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB, with_inputs

NO_DROPOUT = {**TINY, "dropout": 0.0, "fusion_attention_dropout": 0.0}


def mf(name: str = "mask_fusion", seed: int = 0, **fields):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **NO_DROPOUT, "bert": TINY_BERT, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS).eval()


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("theta", [-0.01, 1.5])
def test_bad_theta_is_a_one_line_config_error(theta):
    with pytest.raises(ConfigError, match=r"^model.mask_threshold: must be in \[0, 1\]") as e:
        ExperimentConfig.from_dict({"model": {"name": "mask_fusion", "mask_threshold": theta, "bert": TINY_BERT}})
    assert "\n" not in str(e.value)
    base = ExperimentConfig.from_dict({"model": {"name": "mask_fusion", "bert": TINY_BERT}})
    assert base.model.mask_threshold == 0.03  # Table 5's best, the default
    with pytest.raises(ConfigError, match=r"^model.mask_threshold: must be in \[0, 1\]"):
        base.with_overrides({"model.mask_threshold": str(theta)})
    assert base.with_overrides({"model.mask_threshold": "1"}).model.mask_threshold == 1.0


def test_other_fields_are_validated_naming_the_key():
    def build(**fields):
        return ExperimentConfig.from_dict({"model": {"name": "mask_fusion", "bert": TINY_BERT, **fields}})

    with pytest.raises(ConfigError, match=r"^model.bert.name: mask_fusion needs a BERT"):
        ExperimentConfig.from_dict({"model": {"name": "mask_fusion"}})
    with pytest.raises(ConfigError, match=r"^model.embedding_fusion: must be one of mask, gate, none"):
        build(embedding_fusion="masked")
    with pytest.raises(ConfigError, match=r"^model.bert_layers: must be 'all' or 'last'"):
        build(bert_layers="first")
    with pytest.raises(ConfigError, match=r"^model.adaptive_fusion: with model.embedding_fusion=none"):
        build(embedding_fusion="none", adaptive_fusion=False)
    with pytest.raises(ConfigError, match=r"^model.fusion_attention_dropout: must be < 1"):
        build(fusion_attention_dropout=1.0)
    with pytest.raises(ConfigError, match=r"^model.mask_scale: must be one of sqrt_d, d"):
        build(mask_scale="512")
    with pytest.raises(ConfigError, match=r"^model.mask_estimator: must be one of straight_through, frozen"):
        build(mask_estimator="gumbel")
    with pytest.raises(ConfigError, match=r"^model.mask_temperature: must be > 0"):
        build(mask_temperature=0.0)
    cfg = build().model
    assert (cfg.mask_scale, cfg.mask_estimator) == ("sqrt_d", "straight_through")  # the defaults
    with pytest.raises(ConfigError, match=r"^model.bert_layers: model mask_fusion_m1 is defined by"):
        ExperimentConfig.from_dict({"model": {"name": "mask_fusion_m1", "bert_layers": "all", "bert": TINY_BERT}})


# ---------------------------------------------------------------------- Eq. 1-2
def test_layer_fusion_is_a_glu_over_the_layer_axis():
    torch.manual_seed(0)
    states = torch.randn(2, 3, 4, 5)  # (B, T, n, H)
    fusion = LayerFusion(4)
    # Init: value channel = B_n, gate 0 → B = B_n · σ(0) = B_n / 2.
    torch.testing.assert_close(fusion(states), states[:, :, -1] / 2, rtol=0, atol=0)
    w = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.0, 0.0, -0.5, 3.0]])  # W^T: (2, n)
    with torch.no_grad():
        fusion.proj.weight.copy_(w)
    got = fusion(states)
    assert got.shape == (2, 3, 5)
    value = sum(w[0, i] * states[:, :, i] for i in range(4))  # Eq. 1-2: (B̂ W)[..., 0]
    gate = sum(w[1, i] * states[:, :, i] for i in range(4))  # (B̂ W)[..., 1]
    torch.testing.assert_close(got, value * torch.sigmoid(gate))
    # By hand on one element: B[0, 0, 0] = (Σ_i W_i0 B_i) σ(Σ_i W_i1 B_i).
    x = states[0, 0, :, 0].tolist()
    v = sum(a * b for a, b in zip(w[0].tolist(), x))
    g = sum(a * b for a, b in zip(w[1].tolist(), x))
    assert math.isclose(got[0, 0, 0].item(), v / (1 + math.exp(-g)), rel_tol=1e-5)


def test_model_fuses_layers_1_to_l_and_m1_reads_the_last_layer(small_batch):
    m0, m1 = mf(), mf("mask_fusion_m1")
    batch = with_inputs(m0, small_batch)
    out0, out1 = m0.bert(batch), m1.bert(batch)
    assert len(out0.states) == m0.bert.num_layers + 1 and out1.layers == (m1.bert.num_layers,)
    with torch.no_grad():
        m0.layer_fusion.proj.weight.normal_()
        want = m0.layer_fusion(torch.stack(out0.states[1:], dim=2))  # embeddings (state 0) excluded
        torch.testing.assert_close(m0.bert_memory(out0), want)
    torch.testing.assert_close(m1.bert_memory(out1), out0.states[-1])  # M1: B = B_L


# ---------------------------------------------------------------------- Eq. 3-6
D = 8  # d_model of the hand-sized module


def knowledge(threshold: float, use_mask: bool = True, seed: int = 0, estimator: str = "frozen") -> MaskKnowledge:
    torch.manual_seed(seed)
    return MaskKnowledge(d_model=D, bert_dim=6, threshold=threshold, fill=-1e-9, scale=math.sqrt(D),
                         use_mask=use_mask, estimator=estimator)


def without_mask(mod: MaskKnowledge) -> MaskKnowledge:
    """The M2 module (gate only) with ``mod``'s w2, w3."""
    other = knowledge(mod.threshold, use_mask=False)
    other.load_state_dict({k: v for k, v in mod.state_dict().items() if not k.startswith("mask_query.")})
    return other


def hand_tensors():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(2, 5, 8, generator=g) * 4  # E (B, S, C)
    cls = torch.randn(2, 6, generator=g)  # B_CLS (B, H)
    tok = torch.randn(2, 5, 6, generator=g)  # B per NMT token (B, S, H)
    src_mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    return emb, cls, tok, src_mask


def by_hand_attention(w1, b, emb, cls, src_mask, scale: float):
    """Eq. 3 written out per sentence: a = softmax over its non-padding positions of E (B_CLS w1 + b)ᵀ / scale,
    from the weights w1 (C, H), b (C) and a scale the caller states (√d or d), not the module's."""
    out = torch.zeros(src_mask.shape)
    for i in range(emb.size(0)):
        q = w1 @ cls[i] + b  # (C,)
        n = int((~src_mask[i]).sum())
        out[i, :n] = torch.softmax(emb[i, :n] @ q / scale, dim=0)  # (n,): positions j < n, e_j · q / scale
    return out


def test_theta_zero_masks_nothing_and_theta_one_masks_everything():
    emb, cls, tok, src_mask = hand_tensors()
    with torch.no_grad():
        new0, m0 = knowledge(0.0)(emb, cls, tok, src_mask)
        new1, m1 = knowledge(1.0)(emb, cls, tok, src_mask)
        gate_only, m_none = without_mask(knowledge(0.0))(emb, cls, tok, src_mask)
    assert not m0.any() and not m_none.any()
    assert torch.equal(m1, ~src_mask)  # every real position, padding never marked
    torch.testing.assert_close(new0, gate_only, rtol=0, atol=0)  # θ = 0: Ẽ = E, the M2 embedding E + G
    # θ = 1: Ẽ is the fill value everywhere, so the new embedding is fill + G.
    mod = knowledge(1.0)
    with torch.no_grad():
        b = mod.bert_proj(tok)
        lam = torch.relu(mod.gate(torch.cat([b, emb], -1)))  # Eq. 6
        g = lam * b + (1 - lam) * emb  # Eq. 5
    real = ~src_mask
    torch.testing.assert_close(new1[real], (g - 1e-9)[real])
    torch.testing.assert_close(new0, emb + g)


def test_mask_matrix_thresholds_eq_3_softmax():
    emb, cls, tok, src_mask = hand_tensors()
    mod = knowledge(0.0)
    with torch.no_grad():
        w1, b = mod.mask_query.weight, mod.mask_query.bias
        a = by_hand_attention(w1, b, emb, cls, src_mask, math.sqrt(D))
        assert a[src_mask].eq(0).all() and torch.allclose(a.sum(-1), torch.ones(2))
        a_d = by_hand_attention(w1, b, emb, cls, src_mask, D)  # the other reading of Eq. 3: a different A
        assert not torch.allclose(a, a_d, atol=1e-3)
        torch.testing.assert_close(mod.attention(emb, cls, src_mask), a)
        vals = a[~src_mask].sort().values  # θ halfway between two neighbours: masks some positions, not all, and
        theta = ((vals[3] + vals[4]) / 2).item()  # no value sits on θ, where float rounding could flip it
        mod.threshold = theta
        new, m = mod(emb, cls, tok, src_mask)
        assert torch.equal(m, (a < theta) & ~src_mask) and 0 < int(m.sum()) < int((~src_mask).sum())
        gate_only, _ = without_mask(mod)(emb, cls, tok, src_mask)
    torch.testing.assert_close(new[~m], gate_only[~m], rtol=0, atol=0)  # unmasked rows: E + G
    torch.testing.assert_close(new[m], gate_only[m] - emb[m] - 1e-9)  # masked rows: Ẽ + G, Ẽ = fill


@pytest.mark.parametrize("scale", ["sqrt_d", "d"])
def test_the_model_scales_eq_3_by_sqrt_d_unless_told_d(small_batch, scale):
    """The model built from its config divides Eq. 3's scores by √d_model (default) or d_model, checked
    against Eq. 3 by hand with the scale written here (d_model = 32)."""
    fields = {} if scale == "sqrt_d" else {"mask_scale": "d"}
    model = mf(**fields)
    batch = with_inputs(model, small_batch)
    want_scale = math.sqrt(TINY["d_model"]) if scale == "sqrt_d" else float(TINY["d_model"])
    with torch.no_grad():
        bert = model.bert_memory(model.bert(batch))
        e = model.src_embed(batch.src) * model.embed_scale + model.positions(batch.src.size(1))  # E
        q = model.knowledge.mask_query
        a = by_hand_attention(q.weight, q.bias, e, bert[:, 0], batch.src_mask, want_scale)
        torch.testing.assert_close(model.knowledge.attention(e, bert[:, 0], batch.src_mask), a)
        theta = a[~batch.src_mask].median().item()
        model.knowledge.threshold = theta
        assert torch.equal(model(batch).knowledge_mask, (a < theta) & ~batch.src_mask)


def test_model_masks_per_theta_and_pools_bert_through_the_alignment(small_batch):
    batch = with_inputs(mf(), small_batch)
    real = ~batch.src_mask
    assert not mf(mask_threshold=0.0)(batch).knowledge_mask.any()
    assert torch.equal(mf(mask_threshold=1.0)(batch).knowledge_mask, real)
    model = mf()
    with torch.no_grad():
        bert = model.bert_memory(model.bert(batch))
        got, m = model.embed_source(batch, bert)
        tok, _ = pool_to_tokens(bert, batch.extras["bert_align"])  # B per NMT token
        e = model.src_embed(batch.src) * model.embed_scale + model.positions(batch.src.size(1))
        want, m_want = model.knowledge(e, bert[:, 0], tok, batch.src_mask)  # B_CLS = the [CLS] position
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(m, m_want)


def test_straight_through_forwards_the_hard_mask_and_backwards_the_soft_one():
    """Forward: exactly the frozen variant's output (the hard M of Eq. 4). Backward: w1, b get the gradient
    of the soft mask σ((θ − a_i)/τ) put in M's place, computed here by hand from Eq. 3."""
    emb, cls, tok, src_mask = hand_tensors()
    frozen, ste = knowledge(0.0, estimator="frozen"), knowledge(0.0, estimator="straight_through")
    with torch.no_grad():
        a = by_hand_attention(ste.mask_query.weight, ste.mask_query.bias, emb, cls, src_mask, math.sqrt(D))
    theta = a[~src_mask].median().item()
    frozen.threshold = ste.threshold = theta
    r = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3))  # a probe loss: Σ r ⊙ (Ẽ + G)
    new_f, m_f = frozen(emb, cls, tok, src_mask)
    new_s, m_s = ste(emb, cls, tok, src_mask)
    assert torch.equal(m_f, m_s) and 0 < int(m_s.sum()) < int((~src_mask).sum())
    torch.testing.assert_close(new_s, new_f, rtol=0, atol=0)  # the forward is the hard mask exactly
    (new_s * r).sum().backward()
    assert all(not p.requires_grad for p in frozen.mask_query.parameters())
    w1 = ste.mask_query.weight.detach().clone().requires_grad_()
    b = ste.mask_query.bias.detach().clone().requires_grad_()
    soft = torch.sigmoid((theta - by_hand_attention(w1, b, emb, cls, src_mask, math.sqrt(D))) / 0.01)
    # d/dw of Σ_i r_i · (E_i (1 − s_i) + fill s_i): the rows' sensitivity to being masked, times ds_i/dw.
    (((r * (-1e-9 - emb)).sum(-1) * soft * ~src_mask).sum()).backward()
    assert ste.mask_query.weight.grad.abs().sum() > 0
    torch.testing.assert_close(ste.mask_query.weight.grad, w1.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ste.mask_query.bias.grad, b.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("estimator", ["straight_through", "frozen"])
def test_mask_query_learns_or_stays_fixed_in_its_own_group(small_batch, estimator):
    model = mf(mask_estimator=estimator, mask_threshold=0.2).train()  # θ near the tiny sources' a_i ≈ 1/length
    batch = with_inputs(model, small_batch)
    lo = label_smoothed_nll(model(batch).logits, batch.tgt_out, 0.1, PAD)
    lo.loss.backward()
    query = list(model.knowledge.mask_query.parameters())
    if estimator == "frozen":
        assert all(not p.requires_grad and p.grad is None for p in query)  # fixed at the seeded init
    else:
        assert all(p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0 for p in query)
    for mod in (model.layer_fusion, model.knowledge.bert_proj, model.knowledge.gate, model.adaptive):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mod.parameters()), mod
    groups = parameter_groups(model)
    assert {id(p) for p in groups["mask_query"]} == {id(p) for p in query}
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))


def test_the_trainer_reports_the_validation_masked_fraction(tmp_path):
    """``valid_masked_fraction`` = masked / real source tokens over the validation set, from the model's
    ``knowledge_mask``; a model without one reports none."""
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "mask_fusion", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.mask_threshold": 0.15,
                                       "train.num_threads": 1})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    split = trainer.data.splits["valid"]
    masked = real = 0
    trainer.model.eval()
    with torch.no_grad():
        for batch in trainer.eval_batches(split):
            m = trainer.model(batch).knowledge_mask
            masked, real = masked + int(m.sum()), real + int((~batch.src_mask).sum())
    metrics = trainer.validate()
    assert 0 < masked < real and metrics["valid_masked_fraction"] == pytest.approx(masked / real)
    plain = build_trainer(tiny_experiment(tmp_path / "t", **{"train.num_threads": 1}), device=torch.device("cpu"))
    torch.set_num_threads(2)
    assert "valid_masked_fraction" not in plain.validate()


# ---------------------------------------------------------------------- the mask on real Multi30k batches
@pytest.fixture(scope="module")
def multi30k_mask_fusion(tmp_path_factory, shared_data):
    """The θ study's model (Multi30k En→De, multi30k_small sizes, the packaged MiniLM, config defaults) at its
    seeded init, and 384 validation sentences as three real batches with their BERT stream."""
    import numpy as np

    from nmtcore.bert import prepare_bert_inputs
    from nmtcore.config import preset
    from nmtcore.data import collate, prepare_data

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = preset("multi30k_small").with_overrides({
        "data.data_dir": str(shared_data), "data.download": False, "data.test_splits": ["val"],
        "data.cache_dir": str(tmp_path_factory.mktemp("m30k_mask")), "model.name": "mask_fusion",
        "model.bert.name": "minilm"})
    data = prepare_data(cfg.data)
    torch.manual_seed(1)
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id).eval()
    prepare_bert_inputs(model, data, use_cache=False)  # BERT runs on these batches only
    split = data.splits["val"]
    batches = [collate(split, np.arange(i, i + 128), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
               for i in range(0, 384, 128)]
    yield model, batches
    torch.set_num_threads(threads)


def test_on_real_multi30k_the_mask_selects_by_content_not_length(multi30k_mask_fusion):
    """Table 5's θ grid on real sentences: the model's mask is Eq. 3-4 with √d (by hand); the masked fraction
    changes across θ ∈ {0.01 … 0.05}; equal-length sentences get different masked counts and many sentences
    are partly masked, so length alone does not decide the mask. Eq. 3 read with d instead (by hand, same
    weights) masks by length: whole sentences or nothing."""
    from collections import defaultdict

    model, batches = multi30k_mask_fusion
    d = model.cfg.d_model
    rows: dict[str, list[torch.Tensor]] = {"sqrt_d": [], "d": []}
    with torch.no_grad():
        for batch in batches:
            bert = model.bert_memory(model.bert(batch))
            e = model.src_embed(batch.src) * model.embed_scale + model.positions(batch.src.size(1))  # E
            q = model.knowledge.mask_query
            for name, scale in (("sqrt_d", math.sqrt(d)), ("d", float(d))):
                a = by_hand_attention(q.weight, q.bias, e, bert[:, 0], batch.src_mask, scale)
                if name == "sqrt_d":  # the model (config defaults, θ = 0.03) masks exactly as Eq. 3-4 with √d
                    want = (a < model.cfg.mask_threshold) & ~batch.src_mask
                    got = model.embed_source(batch, bert)[1]  # the mask the model's forward applies
                    near = (a - model.cfg.mask_threshold).abs() < 1e-6  # float ties may go either way
                    assert torch.equal(got & ~near, want & ~near)
                rows[name] += [a[i, : int(n)] for i, n in enumerate((~batch.src_mask).sum(-1))]

    def stats(name: str, theta: float) -> tuple[float, float, float]:
        counts = [int((r < theta).sum()) for r in rows[name]]
        lengths = [len(r) for r in rows[name]]
        by_length: dict[int, set[int]] = defaultdict(set)
        for c, n in zip(counts, lengths):
            by_length[n].add(c)
        common = [n for n in by_length if lengths.count(n) >= 5]  # lengths shared by >= 5 sentences
        varying = sum(len(by_length[n]) > 1 for n in common) / len(common)
        partial = sum(0 < c < n for c, n in zip(counts, lengths)) / len(counts)
        return sum(counts) / sum(lengths), varying, partial

    thetas = (0.01, 0.02, 0.03, 0.04, 0.05)
    fractions = [stats("sqrt_d", t)[0] for t in thetas]
    assert len(set(fractions)) >= 4 and fractions[-1] > 0.1, fractions  # θ changes what is masked
    for theta in (0.04, 0.05):
        _, varying, partial = stats("sqrt_d", theta)
        assert varying >= 0.3 and partial >= 0.1, (theta, varying, partial)  # content, not length
        _, varying_d, partial_d = stats("d", theta)
        assert varying_d <= 0.1 and partial_d <= 0.05, (theta, varying_d, partial_d)  # by length
# ---------------------------------------------------------------------- Eq. 7-9
def test_adaptive_fusion_is_eq_7_to_9():
    torch.manual_seed(0)
    fusion = AdaptiveFusion(8, 6, 0.0).eval()
    enc, bert = torch.randn(2, 4, 8), torch.randn(2, 5, 6)
    bert_mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    att = fusion.attn
    with torch.no_grad():
        got = fusion(enc, bert, bert_mask)
        for b in range(2):
            n = int((~bert_mask[b]).sum())
            k, v = att.kv(bert[b, :n]).chunk(2, dim=-1)  # (n, C)
            q = att.q(enc[b])  # (S, C)
            e_attn = att.out(torch.softmax(q @ k.T / math.sqrt(8), dim=-1) @ v)  # Eq. 7, one head
            eta = torch.sigmoid(enc[b] @ fusion.u.weight.T + e_attn @ fusion.v.weight.T)  # Eq. 8
            torch.testing.assert_close(got[b], (1 - eta) * enc[b] + eta * e_attn)  # Eq. 9


# ---------------------------------------------------------------------- ablations (Table 4)
def test_ablations_differ_from_m0_only_where_documented(small_batch):
    bert = BertConfig(**TINY_BERT)
    m0_cfg = MaskFusionConfig(bert=bert)
    for name, fields in ABLATIONS.items():
        cfg = MODEL_CONFIGS[name](bert=bert)
        assert model_class(cfg) is model_class(m0_cfg)
        diff = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(m0_cfg, f.name)}
        assert diff == {"name", *fields}, name
    models = {name: mf(name) for name in ("mask_fusion", *ABLATIONS)}
    params = {name: {k for k, _ in m.named_parameters()} for name, m in models.items()}
    full = params["mask_fusion"]
    assert params["mask_fusion_m1"] == full - {k for k in full if k.startswith("layer_fusion.")}
    assert params["mask_fusion_m2"] == full - {k for k in full if k.startswith("knowledge.mask_query.")}
    assert params["mask_fusion_m3"] == full - {k for k in full if k.startswith("adaptive.")}

    batch = with_inputs(models["mask_fusion"], small_batch)
    m0 = mf(mask_threshold=0.0)
    with torch.no_grad():
        # M2 (no mask matrix) is M0 at θ = 0: with the same weights, the same logits.
        m2 = models["mask_fusion_m2"]
        missing, unexpected = m2.load_state_dict(m0.state_dict(), strict=False)
        assert not missing and all(k.startswith("knowledge.mask_query.") for k in unexpected) and unexpected
        torch.testing.assert_close(m2(batch).logits, m0(batch).logits, rtol=0, atol=0)
        assert m0(batch).knowledge_mask is not None
        # M3 (no adaptive fusion): the decoder reads E_N, the encoder's top, which M0 fuses with B.
        m3 = models["mask_fusion_m3"]
        m3.load_state_dict(m0.state_dict(), strict=False)
        enc3 = m3.encode(batch).out
        bert_out = m0.bert(batch)
        torch.testing.assert_close(m0.encode(batch).out, m0.adaptive(enc3, m0.bert_memory(bert_out), bert_out.mask))
        # M1 (last layer only): M0 with its GLU replaced by B_L, everything else shared.
        m1 = models["mask_fusion_m1"]
        m1.load_state_dict({k: v for k, v in m0.state_dict().items() if not k.startswith("layer_fusion.")})
        m0.layer_fusion.forward = lambda states: states[:, :, -1]  # type: ignore[method-assign]
        torch.testing.assert_close(m1(batch).logits, m0(batch).logits)


# ---------------------------------------------------------------------- what a trained model draws from BERT
def trained_like(name: str = "mask_fusion", seed: int = 0, **fields):
    """A mask-fusion variant whose every BERT path is live: the GLU and Eq. 3's query away from their inits, θ
    high enough that the small batch has masked and unmasked tokens."""
    m = mf(name, seed, **{"mask_threshold": 0.2, **fields})
    with torch.no_grad():
        if m.layer_fusion is not None:
            m.layer_fusion.proj.weight.normal_()
    return m


def test_inference_switches_turn_off_each_way_in_and_restore(small_batch):
    m0 = trained_like()
    batch = with_inputs(m0, small_batch)
    switches = m0.inference_switches()
    assert list(switches) == ["tested", "mask_off", "gate_bert_off", "adaptive_off", "bert_off"]
    assert list(mf("mask_fusion_m2").inference_switches()) == ["tested", "gate_bert_off", "adaptive_off", "bert_off"]
    assert list(mf("mask_fusion_m3").inference_switches()) == ["tested", "mask_off", "gate_bert_off", "bert_off"]
    assert list(mf("mask_fusion_m1").inference_switches()) == list(switches)

    def logits(model, switch=None):
        with torch.no_grad(), (model.inference_switches()[switch]() if switch else contextlib.nullcontext()):
            return model(batch).logits

    tested = logits(m0)
    assert bool(m0(batch).knowledge_mask.any()) and not bool(m0(batch).knowledge_mask.all())
    out = {name: logits(m0, name) for name in switches}
    torch.testing.assert_close(out["tested"], tested, rtol=0, atol=0)
    for name in ("mask_off", "gate_bert_off", "adaptive_off", "bert_off"):
        assert not torch.allclose(out[name], tested), name  # each switch changes what the model computes
    torch.testing.assert_close(logits(m0), tested, rtol=0, atol=0)  # restored after each block
    # mask_off is M2 (no mask matrix) with M0's weights; adaptive_off is M3 (no adaptive fusion).
    for name, switch in (("mask_fusion_m2", "mask_off"), ("mask_fusion_m3", "adaptive_off")):
        other = trained_like(name)  # θ as M0's
        other.load_state_dict(m0.state_dict(), strict=False)
        torch.testing.assert_close(out[switch], logits(other), rtol=0, atol=0)
    # gate_bert_off is λ = 0 in Eq. 5: the model with Eq. 6's w2 zero.
    zero_gate = trained_like()
    zero_gate.load_state_dict(m0.state_dict())
    with torch.no_grad():
        zero_gate.knowledge.gate.weight.zero_()
    torch.testing.assert_close(out["gate_bert_off"], logits(zero_gate), rtol=0, atol=0)
    # bert_off: nothing of BERT reaches the output; another BERT changes the tested logits, not these.
    with torch.no_grad():
        for p in m0.bert.parameters():
            p.add_(torch.randn_like(p))
    assert not torch.allclose(logits(m0), tested)
    torch.testing.assert_close(logits(m0, "bert_off"), out["bert_off"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown mask-fusion switch"):
        with m0.switched_off("glu"):
            pass


def test_usage_figures_are_the_glu_weights_and_the_mean_gates(small_batch):
    m0 = trained_like()
    batch = with_inputs(m0, small_batch)
    usage = m0.bert_usage()
    n = m0.bert.num_layers
    w = m0.layer_fusion.proj.weight
    assert usage == {**{f"glu_value/L{i + 1}": float(w[0, i]) for i in range(n)},
                     **{f"glu_gate/L{i + 1}": float(w[1, i]) for i in range(n)}}
    assert mf().bert_usage()[f"glu_value/L{n}"] == 1.0 and mf("mask_fusion_m1").bert_usage() == {}

    with torch.no_grad(), m0.usage_probe() as figures:
        mask = m0(batch).knowledge_mask
    real = ~batch.src_mask
    # By hand: λ (Eq. 6) and η (Eq. 8) from the model's pieces, each token's mean over channels, then over tokens.
    with torch.no_grad():
        bert_out = m0.bert(batch)
        bert = m0.bert_memory(bert_out)
        e = m0.src_embed(batch.src) * m0.embed_scale + m0.positions(batch.src.size(1))
        b = m0.knowledge.bert_proj(pool_to_tokens(bert, batch.extras["bert_align"])[0])
        lam = torch.relu(m0.knowledge.gate(torch.cat([b, e], dim=-1)))
        with m0.switched_off("adaptive"):
            e_n = m0.encode(batch).out
        att = m0.adaptive.attn(e_n, bert, bert_out.mask)
        eta = torch.sigmoid(m0.adaptive.u(e_n) + m0.adaptive.v(att))
    assert figures["masked_fraction"] == pytest.approx(float(mask.sum()) / float(real.sum()))
    assert figures["gate_lambda"] == pytest.approx(float(lam.mean(-1)[real].mean()), rel=1e-5)
    assert figures["adaptive_eta"] == pytest.approx(float(eta.mean(-1)[real].mean()), rel=1e-5)
    assert 0 < figures["adaptive_eta"] < 1 and figures["gate_lambda"] > 0
    assert m0.knowledge.tap is None and m0.adaptive.tap is None  # the probe leaves nothing behind
    m3 = mf("mask_fusion_m3")
    with torch.no_grad(), m3.usage_probe() as figures:
        m3(with_inputs(m3, small_batch))
    assert set(figures) == {"masked_fraction", "gate_lambda"}


# ---------------------------------------------------------------------- warm start (Section 2.4)
def test_warm_start_from_the_baseline_loads_every_transformer_tensor(tmp_path):
    torch.manual_seed(1)
    base_cfg = ExperimentConfig.from_dict({"model": {"name": "transformer", **TINY, "dropout": 0.0}})
    base = build_model(base_cfg.model, VOCAB, PAD, BOS, EOS)
    path = save_checkpoint(tmp_path / "base.pt", {"model": base.state_dict(), "config": base_cfg.to_dict(),
                                                  "vocab": {"checksum": "v1"}})
    cfg = ExperimentConfig.from_dict({"model": {"name": "mask_fusion", **NO_DROPOUT, "bert": TINY_BERT}})
    torch.manual_seed(2)
    model = build_model(cfg.model, VOCAB, PAD, BOS, EOS)
    report = warm_start(model, path, cfg, SimpleNamespace(checksum="v1"))
    state = model.state_dict()
    assert set(report.loaded) == set(base.state_dict())
    for k, v in base.state_dict().items():
        assert torch.equal(state[k], v), k
    new = {k.split(".")[0] for k in report.fresh}
    assert new == {"bert", "layer_fusion", "knowledge", "adaptive"}
