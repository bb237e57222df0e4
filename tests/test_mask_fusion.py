"""Mask-fusion identities (seed 004): the GLU over BERT layers (Eq. 1-2), the mask knowledge matrix (Eq. 3-6:
θ = 0 masks nothing, θ = 1 everything), the adaptive fusion (Eq. 7-9), the ablations M1-M3 (Table 4)
differing from M0 only where documented, θ validation, and the warm start from a baseline."""

from __future__ import annotations

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
from nmtcore.engine import warm_start
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
    with pytest.raises(ConfigError, match=r"^model.mask_divisor: must be >= 0"):
        build(mask_divisor=-1.0)
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
def knowledge(threshold: float, use_mask: bool = True, seed: int = 0) -> MaskKnowledge:
    torch.manual_seed(seed)
    return MaskKnowledge(d_model=8, bert_dim=6, threshold=threshold, fill=-1e-9, divisor=8.0, use_mask=use_mask)


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


def by_hand_attention(mod: MaskKnowledge, emb, cls, src_mask):
    """Eq. 3 written out per sentence: a = softmax over its non-padding positions of E (B_CLS w1 + b)ᵀ / d."""
    out = torch.zeros(src_mask.shape)
    for b in range(emb.size(0)):
        q = mod.mask_query.weight @ cls[b] + mod.mask_query.bias  # (C,)
        n = int((~src_mask[b]).sum())
        scores = torch.stack([emb[b, i] @ q / mod.divisor for i in range(n)])
        out[b, :n] = torch.softmax(scores, dim=0)
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
        a = by_hand_attention(mod, emb, cls, src_mask)
        assert a[src_mask].eq(0).all() and torch.allclose(a.sum(-1), torch.ones(2))
        theta = a[~src_mask].median().item()  # masks some positions, not all
        mod.threshold = theta
        new, m = mod(emb, cls, tok, src_mask)
        assert torch.equal(m, (a < theta) & ~src_mask) and 0 < int(m.sum()) < int((~src_mask).sum())
        gate_only, _ = without_mask(mod)(emb, cls, tok, src_mask)
    torch.testing.assert_close(new[~m], gate_only[~m], rtol=0, atol=0)  # unmasked rows: E + G
    torch.testing.assert_close(new[m], gate_only[m] - emb[m] - 1e-9)  # masked rows: Ẽ + G, Ẽ = fill


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


def test_mask_query_is_fixed_and_in_its_own_group(small_batch):
    model = mf().train()
    batch = with_inputs(model, small_batch)
    lo = label_smoothed_nll(model(batch).logits, batch.tgt_out, 0.1, PAD)
    lo.loss.backward()
    query = list(model.knowledge.mask_query.parameters())
    assert all(not p.requires_grad and p.grad is None for p in query)  # Eq. 4's step passes no gradient
    for mod in (model.layer_fusion, model.knowledge.bert_proj, model.knowledge.gate, model.adaptive):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mod.parameters()), mod
    groups = parameter_groups(model)
    assert {id(p) for p in groups["mask_query"]} == {id(p) for p in query}
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))


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
