"""BERT-JAM identities (seed 000): joint attention is one softmax over concatenated keys (Eq. 5-7), the GLU
at init is B_L/2 and B_L under phase 1's ×2 (Eq. 8, 11), and the ablations M1-M3 differ from M0 only
where Table 7 says."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nmtcore.config import BERT_JAM_ABLATIONS as ABLATIONS
from nmtcore.config import (
    MODEL_CONFIGS,
    BertConfig,
    BertJamConfig,
    ConfigError,
    ExperimentConfig,
    PhaseConfig,
)
from nmtcore.models import build_model, model_class
from nmtcore.models.bert_jam import JointAttention, LayerGLU
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB, with_inputs


def jam(name: str = "bert_jam", seed: int = 0, **fields):
    torch.manual_seed(seed)
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, "dropout": 0.0, "bert": TINY_BERT, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS).eval()


def by_hand_joint_attention(att: JointAttention, x, x_mask, mem, mem_mask, causal):
    """Eq. 5-7 written out: per head, scores against [K^R ; K^S], one softmax, values [V^R ; V^S]."""
    B, T, C = x.shape
    H, Dh = att.heads, C // att.heads
    q, kr, vr = att.qkv(x).chunk(3, dim=-1)
    ks, vs = att.kv_memory(mem).chunk(2, dim=-1)
    out = torch.zeros(B, T, C)
    for b in range(B):
        for h in range(H):
            sl = slice(h * Dh, (h + 1) * Dh)
            K = torch.cat([kr[b, :, sl], ks[b, :, sl]])  # Eq. 5 (T + M, Dh)
            V = torch.cat([vr[b, :, sl], vs[b, :, sl]])
            e = q[b, :, sl] @ K.T / math.sqrt(Dh)  # (T, T + M)
            for i in range(T):
                for j in range(T):
                    if (x_mask is not None and x_mask[b, j]) or (causal and j > i):
                        e[i, j] = -math.inf
                for j in range(mem.size(1)):
                    if mem_mask[b, j]:
                        e[i, T + j] = -math.inf
            out[b, :, sl] = torch.softmax(e, dim=-1) @ V  # Eq. 6-7
    return att.out(out)


@pytest.mark.parametrize("causal", [False, True])
def test_joint_attention_is_one_softmax_over_concatenated_keys(causal):
    torch.manual_seed(0)
    att = JointAttention(16, 4, 0.0, kdim=12).eval()
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 3, 12)
    x_mask = None if causal else torch.tensor([[False] * 5, [False, False, False, True, True]])
    mem_mask = torch.tensor([[False, False, False], [False, False, True]])
    with torch.no_grad():
        got = att(x, x_mask, mem, mem_mask, causal=causal)
        want = by_hand_joint_attention(att, x, x_mask, mem, mem_mask, causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_glu_at_init_is_half_the_last_layer_and_phase_one_doubles_it():
    torch.manual_seed(0)
    states = torch.randn(2, 4, 3, 8)  # (B, M, L_B, H)
    glu = LayerGLU(3, gated=True)
    torch.testing.assert_close(glu(states), states[:, :, -1] / 2, rtol=0, atol=0)  # Eq. 8 + 11: B = B_L / 2
    assert torch.equal(LayerGLU(3, gated=False)(states), states[:, :, -1])  # M1: B = B_L
    model = jam()
    all_states = torch.randn(2, 4, model.bert.num_layers, model.bert.hidden_size)
    layer = model.encoder_layers[0]
    torch.testing.assert_close(model.compose(layer, all_states), all_states[:, :, -1] / 2, rtol=0, atol=0)
    warmup = model.default_phases()[0]
    assert warmup.name == "warmup" and warmup.glu_scale == 2.0
    model.set_phase(warmup)
    torch.testing.assert_close(model.compose(layer, all_states), all_states[:, :, -1], rtol=0, atol=0)
    model.set_phase(model.default_phases()[1])
    torch.testing.assert_close(model.compose(layer, all_states), all_states[:, :, -1] / 2, rtol=0, atol=0)


def test_glu_scale_travels_with_the_checkpoint():
    model = jam()
    model.set_phase(PhaseConfig("warmup", 1, ("nmt",), glu_scale=2.0))
    other = jam(seed=3)
    other.load_state_dict(model.state_dict())
    assert other.glu_scale.item() == 2.0


def test_every_layer_has_its_own_glu():
    model = jam()
    glus = [layer.glu for layer in [*model.encoder_layers, *model.decoder_layers]]
    assert len({id(g.alpha) for g in glus}) == len(glus) == TINY["encoder_layers"] + TINY["decoder_layers"]
    assert all(g.alpha.numel() == model.bert.num_layers for g in glus)  # B_1..B_L, embeddings excluded


def test_default_schedule_is_section_2_4():
    phases = jam().default_phases()
    assert [(p.name, p.epochs, p.trainable, p.glu_scale, p.early_stop) for p in phases] == [
        ("warmup", 40, ("nmt",), 2.0, False),
        ("glu", 10, ("nmt", "glu"), 1.0, False),
        ("finetune", 10, ("nmt", "glu", "bert"), 1.0, True),
    ]


def test_ablations_differ_from_m0_only_where_documented():
    bert = BertConfig(**TINY_BERT)
    m0 = BertJamConfig(bert=bert)
    for name, fields in ABLATIONS.items():
        cfg = MODEL_CONFIGS[name](bert=bert)
        assert model_class(cfg) is model_class(m0)
        diff = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(m0, f.name)}
        assert diff == {"name", *fields}, name
    models = {name: jam(name) for name in ("bert_jam", "bert_jam_m1", "bert_jam_m2", "bert_jam_m3")}
    params = {name: {k for k, _ in m.named_parameters()} for name, m in models.items()}
    glu_beta = {k for k in params["bert_jam"] if k.endswith(".glu.beta")}
    glu_all = {k for k in params["bert_jam"] if ".glu." in k}
    assert params["bert_jam_m1"] == params["bert_jam"] - glu_beta  # M1: no gate
    assert params["bert_jam_m2"] == params["bert_jam"] - glu_all  # M2: no GLU at all
    assert params["bert_jam_m3"] == params["bert_jam"]  # M3: same model, different schedule
    sched = {name: [(p.name, p.epochs, p.glu_scale) for p in m.default_phases()] for name, m in models.items()}
    assert sched["bert_jam_m1"] == [("warmup", 40, 1.0), ("glu", 10, 1.0), ("finetune", 10, 1.0)]  # no ×2
    assert sched["bert_jam_m2"] == [("warmup", 50, 1.0), ("finetune", 10, 1.0)]  # phase 1 prolonged
    assert sched["bert_jam_m3"] == [("glu", 50, 1.0), ("finetune", 10, 1.0)]  # NMT + GLU together
    assert models["bert_jam_m2"].bert.layers == (models["bert_jam_m2"].bert.num_layers,)


def test_a_variant_name_means_exactly_its_fields():
    with pytest.raises(ConfigError, match=r"^model.glu: model bert_jam_m1 is defined by glu='weighted_sum'"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam_m1", "glu": "glu", "bert": TINY_BERT}})
    with pytest.raises(ConfigError, match=r"^model.schedule: model.bert_layers=last has no GLU"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam", "bert_layers": "last", "bert": TINY_BERT}})
    with pytest.raises(ConfigError, match=r"^model.bert.name: bert_jam needs a BERT"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam"}})


def test_decoder_average_is_eq_10(small_batch):
    """With drop-net off the decoder combines its two joint attentions by their plain average."""
    model = jam()
    batch = with_inputs(model, small_batch)
    enc = model.encode(batch)
    layer = model.decoder_layers[0]
    x = model.embed(batch.tgt_in, model.tgt_embed)
    bert = model.compose(layer, enc.extras["bert_states"])
    with torch.no_grad():
        h = layer.attn_res.before(x)
        a = layer.bert_attn(h, None, bert, enc.extras["bert_mask"], causal=True)
        b = layer.enc_attn(h, None, enc.out, enc.mask, causal=True)
        y = layer.attn_res.after(x, (a + b) / 2)
        want = layer.ffn_res.after(y, layer.ffn(layer.ffn_res.before(y)))
        got = layer(x, enc.out, enc.mask, bert, enc.extras["bert_mask"], model.dec_drop_net.weights())
    torch.testing.assert_close(got, want)


def test_three_phases_end_to_end_from_python(tmp_path):
    """``run_experiment`` on BERT-JAM: the model's own three-phase schedule runs (warmup → glu → finetune),
    the cache serves phases 1-2, BERT trains in phase 3 only, and the test set is decoded and scored."""
    from nmtcore.engine import run_experiment
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.phase_epochs": [1, 1, 1],
                                       "train.max_epochs": 10, "train.num_threads": 1})
    summary = run_experiment(cfg)
    assert summary.epochs == 3 and summary.stop_reason == "end_of_schedule"
    assert math.isfinite(summary.test["test"].bleu)
    assert summary.trainable_parameters == summary.parameters  # phase 3 fine-tunes BERT too
