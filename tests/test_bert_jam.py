"""BERT-JAM identities (seed 000): joint attention is one softmax over concatenated keys (Eq. 5-7), the GLU
at init is B_L/2 and B_L under phase 1's ×2 (Eq. 8, 11) and stays Eq. 8 once phase 2 has trained it, the
decoder's drop-net picks one joint attention per layer while training and averages them in eval (Eq. 10),
the three phases train what Section 2.4 says with the frozen-feature cache serving phases 1-2, and the
ablations M1-M3 differ from M0 only where Table 7 says."""

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
from nmtcore.engine import Callback
from nmtcore.engine.losses import label_smoothed_nll
from nmtcore.engine.phases import apply_phase
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
    states = torch.randn(2, 3, 4, 8)  # (B, L_B, M, H)
    glu = LayerGLU(3, gated=True)
    torch.testing.assert_close(glu(states), states[:, -1] / 2, rtol=0, atol=0)  # Eq. 8 + 11: B = B_L / 2
    assert torch.equal(LayerGLU(3, gated=False)(states), states[:, -1])  # M1: B = B_L
    model = jam()
    all_states = torch.randn(2, model.bert.num_layers, 4, model.bert.hidden_size)
    layer = model.encoder_layers[0]
    torch.testing.assert_close(model.compose([layer], all_states)[0], all_states[:, -1] / 2, rtol=0, atol=0)
    warmup = model.default_phases()[0]
    assert warmup.name == "warmup" and warmup.glu_scale == 2.0
    model.set_phase(warmup)
    torch.testing.assert_close(model.compose([layer], all_states)[0], all_states[:, -1], rtol=0, atol=0)
    model.set_phase(model.default_phases()[1])
    torch.testing.assert_close(model.compose([layer], all_states)[0], all_states[:, -1] / 2, rtol=0, atol=0)


def by_hand_glu(glu: LayerGLU, states):
    """Eq. 8 element by element: B = σ(Σ_i β_i B_i) ⊙ Σ_i α_i B_i over the layer axis of states (B, L, M, H)."""
    alpha, beta = glu.alpha.tolist(), glu.beta.tolist()
    mix = sum(a * states[:, i] for i, a in enumerate(alpha))
    gate = 1.0 / (1.0 + torch.exp(-sum(b * states[:, i] for i, b in enumerate(beta))))
    return gate * mix


@pytest.mark.parametrize("gated", [True, False])
def test_glu_keeps_only_the_shared_states_for_backward_and_gives_eq_8s_gradients(gated):
    """Every layer's GLU reads the same stacked BERT states; while training it must keep nothing of its own
    the size of those states (a copy per layer was 29% of a fine-tuned BERT-JAM's activations), and its
    gradients (α, β and the states) are Eq. 8's."""
    torch.manual_seed(0)
    glu = LayerGLU(4, gated=gated)
    with torch.no_grad():
        glu.alpha.copy_(torch.randn(4))
        if gated:
            glu.beta.copy_(torch.randn(4))
    states = torch.randn(3, 4, 5, 16, dtype=torch.float64, requires_grad=True)  # (B, L_B, M, H)
    glu.double()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = glu(states)
    big = [t for t in saved if t.numel() >= states.numel() // 4]
    assert big and all(t.untyped_storage().data_ptr() == states.untyped_storage().data_ptr() for t in big)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    got = {"states": states.grad.clone(), "alpha": glu.alpha.grad.clone(),
           **({"beta": glu.beta.grad.clone()} if gated else {})}
    states.grad = None
    glu.zero_grad()
    if gated:
        expected = by_hand_glu(glu, states)
    else:
        expected = sum(a * states[:, i] for i, a in enumerate(glu.alpha.unbind(0)))
    torch.testing.assert_close(out, expected.detach())
    (expected * weight).sum().backward()
    if gated:  # by_hand_glu reads α, β as floats: their gradients by autograd through the einsum-free form
        torch.testing.assert_close(got["states"], states.grad)
        a, b = glu.alpha.detach().clone().requires_grad_(), glu.beta.detach().clone().requires_grad_()
        mix = sum(a[i] * states.detach()[:, i] for i in range(4))
        gate = torch.sigmoid(sum(b[i] * states.detach()[:, i] for i in range(4)))
        (gate * mix * weight).sum().backward()
        torch.testing.assert_close(got["alpha"], a.grad)
        torch.testing.assert_close(got["beta"], b.grad)
    else:
        torch.testing.assert_close(got["states"], states.grad)
        torch.testing.assert_close(got["alpha"], glu.alpha.grad)


def one_step(model, batch, lr: float = 0.05) -> None:
    """One Adam update on the label-smoothed loss over the parameters the current phase trains."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    label_smoothed_nll(model(batch).logits, batch.tgt_out, 0.1, PAD).loss.backward()
    opt.step()
    model.eval()


def test_glu_is_eq_8_after_training_steps_and_trains_in_phase_2_only(small_batch):
    """Phase 1 (warm-up) leaves every GLU at its Eq. 11 init (frozen) while the NMT weights move, and the ×2
    makes the composed memory B_L; a phase-2 step moves α and β (the gradient reaches them through the
    model) and the composed memory is still exactly Eq. 8 with the trained weights, no longer B_L / 2."""
    model = jam()
    batch = with_inputs(model, small_batch)
    warmup, glu_phase, _ = model.default_phases()
    glus = [layer.glu for layer in [*model.encoder_layers, *model.decoder_layers]]
    init = [(g.alpha.detach().clone(), g.beta.detach().clone()) for g in glus]
    nmt_before = model.src_embed.weight.detach().clone()

    apply_phase(model, warmup)
    one_step(model, batch)
    assert not torch.equal(model.src_embed.weight, nmt_before)  # the NMT model trained
    for g, (a0, b0) in zip(glus, init):
        assert torch.equal(g.alpha, a0) and torch.equal(g.beta, b0)  # GLU frozen in phase 1
    states = torch.stack(model.bert(batch).states[1:], dim=1)  # (B, L, M, H)
    layer = model.encoder_layers[0]
    with torch.no_grad():
        torch.testing.assert_close(model.compose([layer], states)[0], states[:, -1], rtol=0, atol=0)  # 2 · B_L / 2

    apply_phase(model, glu_phase)
    for _ in range(3):
        one_step(model, batch)
    for g, (a0, b0) in zip(glus, init):
        assert not torch.equal(g.alpha, a0) and g.beta.abs().sum() > 0  # trained: off the Eq. 11 init
    with torch.no_grad():
        for layer in [*model.encoder_layers, *model.decoder_layers]:
            got = model.compose([layer], states)[0]
            torch.testing.assert_close(got, by_hand_glu(layer.glu, states), rtol=1e-5, atol=1e-6)  # Eq. 8, scale 1
            assert not torch.allclose(got, states[:, -1] / 2)  # no longer the init's B_L / 2
        layers = [*model.encoder_layers, *model.decoder_layers]  # one product for all of them (no GLU trains)
        for layer, got in zip(layers, model.compose(layers, states)):
            torch.testing.assert_close(got, by_hand_glu(layer.glu, states), rtol=1e-5, atol=1e-6)


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


def test_inference_switches_mask_bert_out_of_each_stack(small_batch):
    """``enc_bert_off``: the encoder's output no longer depends on BERT; ``dec_bert_off``: the encoder is as tested
    and the decoder reads nothing of BERT's states; ``bert_off``: nothing of BERT reaches the logits."""
    model = jam()
    with torch.no_grad():
        for layer in [*model.encoder_layers, *model.decoder_layers]:
            layer.glu.beta.normal_()  # the GLU away from its init, so every BERT layer feeds B
    batch = with_inputs(model, small_batch)
    switches = model.inference_switches()
    assert list(switches) == ["tested", "enc_bert_off", "dec_bert_off", "bert_off"]

    def run(switch: str, perturbed: bool = False):
        with torch.no_grad(), switches[switch]():
            enc = model.encode(batch)
            if perturbed:  # other BERT states for the decoder, the encoder's output kept
                enc.extras["bert_states"] = torch.randn_like(enc.extras["bert_states"])
            return enc.out, model.output_logits(model.run_decoder(batch.tgt_in, enc))

    enc0, tested = run("tested")
    out = {name: run(name) for name in switches}
    torch.testing.assert_close(out["dec_bert_off"][0], enc0, rtol=0, atol=0)  # the encoder as tested
    for name in ("enc_bert_off", "dec_bert_off", "bert_off"):
        assert not torch.allclose(out[name][1], tested), name
    # The decoder under dec_bert_off / bert_off: other BERT states, the same output.
    for name in ("dec_bert_off", "bert_off"):
        torch.testing.assert_close(run(name, perturbed=True)[1], out[name][1], rtol=0, atol=0)
    assert not torch.allclose(run("tested", perturbed=True)[1], tested)
    # Another BERT: the encoder under enc_bert_off and the whole model under bert_off do not move.
    with torch.no_grad():
        for p in model.bert.parameters():
            p.add_(torch.randn_like(p))
    torch.testing.assert_close(run("enc_bert_off")[0], out["enc_bert_off"][0], rtol=0, atol=0)
    torch.testing.assert_close(run("bert_off")[1], out["bert_off"][1], rtol=0, atol=0)
    assert not torch.allclose(run("tested")[0], enc0)
    with pytest.raises(ValueError, match="unknown BERT-JAM stack"):
        with model.bert_switched_off("both"):
            pass


def test_a_variant_name_means_exactly_its_fields():
    with pytest.raises(ConfigError, match=r"^model.glu: model bert_jam_m1 is defined by glu='weighted_sum'"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam_m1", "glu": "glu", "bert": TINY_BERT}})
    with pytest.raises(ConfigError, match=r"^model.schedule: model.bert_layers=last has no GLU"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam", "bert_layers": "last", "bert": TINY_BERT}})
    with pytest.raises(ConfigError, match=r"^model.bert.name: bert_jam needs a BERT"):
        ExperimentConfig.from_dict({"model": {"name": "bert_jam"}})


def by_hand_decoder_layer(layer, x, enc, bert, bert_mask, w):
    """Eq. 10 with branch weights w: w_1 Attn_joint(D, B) + w_2 Attn_joint(D, E^L), residual, FFN."""
    h = layer.attn_res.before(x)
    a = layer.bert_attn(h, None, bert, bert_mask, causal=True)
    b = layer.enc_attn(h, None, enc.out, enc.mask, causal=True)
    y = layer.attn_res.after(x, w[0] * a + w[1] * b)
    return layer.ffn_res.after(y, layer.ffn(layer.ffn_res.before(y)))


@pytest.mark.parametrize("p_net", [0.0, 1.0])
def test_decoder_drop_net_in_train_mode_and_the_eq_10_average_in_eval(small_batch, p_net):
    """In train mode (dropout 0, so drop-net is the only randomness) each decoder layer's output is Eq. 10
    with the weights the drop-net drew: with p_net = 1 one branch only, (1, 0) or (0, 1), both occurring;
    with p_net = 0 the average. In eval mode always the average (Eq. 10 as written)."""
    model = jam(decoder_p_net=p_net)
    batch = with_inputs(model, small_batch)
    with torch.no_grad():
        enc = model.encode(batch)
        layer = model.decoder_layers[0]
        x = model.embed(batch.tgt_in, model.tgt_embed)
        bert = model.compose([layer], enc.extras["bert_states"])[0]
        bert_mask = enc.extras["bert_mask"]
        average = by_hand_decoder_layer(layer, x, enc, bert, bert_mask, (0.5, 0.5))
        first = by_hand_decoder_layer(layer, x, enc, bert, bert_mask, (1.0, 0.0))
        second = by_hand_decoder_layer(layer, x, enc, bert, bert_mask, (0.0, 1.0))
        assert not torch.allclose(first, second) and not torch.allclose(first, average)
        model.train()
        seen = []
        for _ in range(12):
            w = model.dec_drop_net.weights()
            got = layer(x, enc.out, enc.mask, bert, bert_mask, w)
            want = {(1.0, 0.0): first, (0.0, 1.0): second, (0.5, 0.5): average}[w]
            torch.testing.assert_close(got, want)
            seen.append(w)
        assert set(seen) == ({(1.0, 0.0), (0.0, 1.0)} if p_net == 1.0 else {(0.5, 0.5)})
        # Through the whole model: training forwards differ from one another under p_net = 1 (branches drawn
        # per layer and forward), and equal the eval-mode (average) logits under p_net = 0.
        train_logits = [model(batch).logits for _ in range(6)]
        model.eval()
        eval_logits = model(batch).logits
        assert model.dec_drop_net.weights() == (0.5, 0.5)
    if p_net == 1.0:
        assert any(not torch.allclose(train_logits[0], t) for t in train_logits[1:])
        assert all(not torch.allclose(t, eval_logits) for t in train_logits)
    else:
        for t in train_logits:
            torch.testing.assert_close(t, eval_logits)


class PhaseProbe(Callback):
    """A callback recording per epoch: BERT runs (a cache hit means none), whether cached features served the
    batches, and which parameter groups changed during the epoch."""

    def __init__(self):
        self.epochs, self.runs, self.snap = [], [], None

    def groups(self, trainer):
        return {k: [p.detach().clone() for p in v] for k, v in trainer.model.parameter_groups().items()}

    def on_train_start(self, trainer):
        bert = trainer.model.bert
        run = bert.run
        bert.run = lambda *a, **k: self.runs.append(torch.is_grad_enabled()) or run(*a, **k)
        self.snap = self.groups(trainer)

    def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
        now = self.groups(trainer)
        changed = {k for k in now if any(not torch.equal(a, b) for a, b in zip(now[k], self.snap[k]))}
        self.epochs.append({"phase": trainer.phases[trainer.phase_index].name, "bert_runs": len(self.runs),
                            "cache": trainer.model.bert.features_usable, "changed": changed,
                            "grad_runs": sum(self.runs),
                            "batch_features": "bert_features" in next(trainer.train_batches(epoch)).extras})
        self.runs.clear()
        self.snap = now


def test_three_phases_end_to_end_from_python(tmp_path):
    """``run_experiment`` on BERT-JAM: the model's own three-phase schedule runs (warmup → glu → finetune).
    Phases 1-2 are served by the frozen-feature cache (BERT never runs while training or validating), the
    warm-up trains the NMT weights only, phase 2 adds the GLU, phase 3 runs (and trains) BERT; the test set
    is decoded and scored."""
    from nmtcore.engine import run_experiment
    from nmtcore.testing.synthetic import tiny_experiment

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.phase_epochs": [1, 1, 1],
                                       "train.max_epochs": 10, "train.num_threads": 1})
    probe = PhaseProbe()
    summary = run_experiment(cfg, callbacks=[probe])
    assert summary.epochs == 3 and summary.stop_reason == "end_of_schedule"
    assert summary.fit.phase_starts == {"warmup": 1, "glu": 2, "finetune": 3}
    warm, glu, fine = probe.epochs
    assert [e["phase"] for e in probe.epochs] == ["warmup", "glu", "finetune"]
    assert warm["cache"] and glu["cache"] and warm["bert_runs"] == glu["bert_runs"] == 0  # cache hits only
    assert warm["changed"] == {"nmt"} and glu["changed"] == {"nmt", "glu"}
    assert not fine["cache"] and fine["grad_runs"] > 0 and fine["changed"] == {"nmt", "glu", "bert"}
    # Phase 3's batches no longer carry the cached features its BERT cannot use (nor keep their map open).
    assert warm["batch_features"] and glu["batch_features"] and not fine["batch_features"]
    assert math.isfinite(summary.test["test"].bleu)
    assert summary.trainable_parameters == summary.parameters  # phase 3 fine-tunes BERT too
