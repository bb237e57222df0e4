"""Contract tests every registered model must pass (STYLE: one suite for the whole zoo).

A new model registers a tiny case in :mod:`nmtcore.testing.zoo`; the first test fails if one is missing.
"""

from __future__ import annotations

import pytest
import torch

from nmtcore.checkpoint import load_checkpoint, save_checkpoint
from nmtcore.config import MODEL_CONFIGS
from nmtcore.engine.losses import label_smoothed_nll
from nmtcore.models import MODEL_CLASSES, model_class
from nmtcore.testing.zoo import CASES, PAD, VOCAB, make_batch, tiny_model, with_inputs


def test_every_registered_model_has_a_tiny_case_and_builds_its_registered_class():
    assert set(MODEL_CONFIGS) <= {name for name, _ in CASES.values()}
    for case, (name, _) in CASES.items():
        model = tiny_model(case)
        assert type(model.cfg) is MODEL_CONFIGS[name], case
        assert type(model) is model_class(model.cfg) and type(model) in MODEL_CLASSES.values(), case


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_shapes(case, small_batch):
    model = tiny_model(case)
    out = model(with_inputs(model, small_batch))
    assert out.logits.shape == (*small_batch.tgt_in.shape, VOCAB)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_padding_does_not_change_outputs(case):
    model = tiny_model(case).eval()
    src, tgt = [[5, 6, 7]], [[8, 9]]
    alone = model(with_inputs(model, make_batch(src, tgt))).logits[0]
    # Same sentence next to a longer one: it gets padded on both sides; its outputs must not move.
    both = model(with_inputs(model, make_batch(src + [[5, 6, 7, 8, 9, 10, 11]], tgt + [[4, 5, 6, 7, 8]])))
    both = both.logits[0, : alone.size(0)]
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_decoding_equals_teacher_forcing(case, small_batch):
    model = tiny_model(case).eval()
    small_batch = with_inputs(model, small_batch)
    with torch.no_grad():
        full = model(small_batch).logits  # (B, T, V)
        enc = model.encode(small_batch)
        state = model.init_state(enc)
        steps = [model.decode_step(small_batch.tgt_in[:, t : t + 1], enc, state) for t in range(small_batch.tgt_in.size(1))]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)


SWITCHED = sorted(c for c in CASES if CASES[c][0].startswith(("bert_fused", "bert_jam", "mask_fusion", "doc_context"))
                  and c != "doc_context_none")


@pytest.mark.parametrize("case", SWITCHED)
def test_every_inference_switch_decodes_as_it_scores_and_restores_the_tested_model(case, small_batch):
    """Under each inference switch (what the diagnostics decode the validation set with), cached decoding
    equals teacher forcing, and leaving the switch gives the tested model's logits again."""
    model = tiny_model(case).eval()
    small_batch = with_inputs(model, small_batch)
    switches = model.inference_switches()
    assert len(switches) >= 3, case
    with torch.no_grad():
        tested = model(small_batch).logits
        for name, switch in switches.items():
            with switch():
                full = model(small_batch).logits
                enc = model.encode(small_batch)
                state = model.init_state(enc)
                steps = [model.decode_step(small_batch.tgt_in[:, t : t + 1], enc, state)
                         for t in range(small_batch.tgt_in.size(1))]
            torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(model(small_batch).logits, tested, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_decoding_in_bf16_with_fp32_self_attention_caches_equals_teacher_forcing(case, small_batch,
                                                                                       monkeypatch):
    """Beam search's bf16 autocast on the CPU: every decoder self-attention keeps its prefix in fp32 and attends a
    single new position in fp32 (:func:`nmtcore.nn.layers.wide_decoding_cache`, here for any head width, so the
    tiny models take that path); the steps give the teacher-forced logits within bf16 tolerance (models whose
    decoders have no :class:`~nmtcore.nn.SelfAttention`, BERT-JAM's joint attention, check the latter only)."""
    from nmtcore.models.bert_jam import BertJam
    from nmtcore.nn import SelfAttention, layers

    monkeypatch.setattr(layers, "WIDE_CACHE_MIN_HEAD_DIM", 1)
    model = tiny_model(case).eval()
    small_batch = with_inputs(model, small_batch)
    self_caches = []
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.register_forward_pre_hook(lambda m, args, kwargs: self_caches.append(kwargs.get("cache")),
                                             with_kwargs=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(small_batch).logits.float()  # (B, T, V)
        enc = model.encode(small_batch)
        state = model.init_state(enc)
        self_caches.clear()
        steps = [model.decode_step(small_batch.tgt_in[:, t : t + 1], enc, state).float()
                 for t in range(small_batch.tgt_in.size(1))]
    grown = [c for c in self_caches if c is not None]
    assert all(c.self_k.dtype == c.self_v.dtype == torch.float32 for c in grown)
    assert grown or isinstance(model, BertJam)  # whose decoder attends through JointAttention only
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_reorder_follows_beams(case, small_batch):
    model = tiny_model(case).eval()
    small_batch = with_inputs(model, small_batch)
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad():
        enc = model.encode(small_batch)
        state = model.init_state(enc)
        model.decode_step(small_batch.tgt_in[:, :1], enc, state)
        state.reorder(perm)
        enc_p = enc.reorder(perm)
        got = model.decode_step(small_batch.tgt_in[perm, 1:2], enc_p, state)
        full = model(small_batch).logits[perm, 1]
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_few_training_steps_lower_the_loss(case, small_batch):
    model = tiny_model(case)
    small_batch = with_inputs(model, small_batch)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        lo = label_smoothed_nll(model(small_batch).logits, small_batch.tgt_out, 0.1, PAD)
        opt.zero_grad()
        (lo.loss / lo.n_tokens).backward()
        opt.step()
        losses.append(lo.loss.item() / lo.n_tokens)
    assert losses[-1] < losses[0] * 0.9


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_load_round_trip(case, small_batch, tmp_path):
    model = tiny_model(case).eval()
    small_batch = with_inputs(model, small_batch)
    save_checkpoint(tmp_path / "m.pt", {"model": model.state_dict()})
    other = tiny_model(case, seed=123).eval()
    other.load_state_dict(load_checkpoint(tmp_path / "m.pt")["model"])
    with torch.no_grad():
        torch.testing.assert_close(other(small_batch).logits, model(small_batch).logits)


def test_cpu_dropout_keeps_f_dropouts_semantics() -> None:
    from nmtcore.nn import dropout

    torch.manual_seed(3)
    x = torch.ones(200, 50, 64, requires_grad=True)
    for p in (0.1, 0.3):
        y = dropout(x, p, training=True)
        kept = y.ne(0)
        assert abs(kept.float().mean().item() - (1 - p)) < 0.005  # 640k draws: sd 0.0006
        assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(g, y.detach())  # gradient: the same mask and scale
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0, training=True) is x
    assert dropout(x, 1.0, training=True).abs().sum() == 0
    torch.manual_seed(5)
    a = dropout(x, 0.1, True)
    torch.manual_seed(5)
    assert torch.equal(a, dropout(x, 0.1, True))  # seeded like every other draw


def test_a_bert_s_own_dropouts_draw_as_the_platform_s_and_stay_nn_dropouts() -> None:
    """A BertLayer's ``transformers`` model has every ``nn.Dropout`` replaced by :class:`FastDropout` of the same rate:
    the platform's draws (seeded as any other), still ``nn.Dropout`` instances whose ``p`` can be set."""
    from nmtcore.bert import BertLayer
    from nmtcore.config import BertConfig
    from nmtcore.nn import dropout
    from nmtcore.nn.layers import FastDropout, use_fast_dropout
    from nmtcore.testing.zoo import TINY_BERT

    layer = BertLayer(BertConfig(**{**TINY_BERT, "freeze": False}))
    drops = [m for m in layer.bert.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(type(m) is FastDropout for m in drops)
    assert use_fast_dropout(layer.bert) == 0  # nothing plain left
    m = drops[0]
    m.p = 0.3
    x = torch.ones(64, 40, 32)
    torch.manual_seed(7)
    y = m.train()(x)
    torch.manual_seed(7)
    assert torch.equal(y, dropout(x, 0.3, True)) and m.eval()(x) is x


def test_a_bert_s_attention_input_is_cast_once_under_autocast_with_autocast_s_values() -> None:
    """Every BERT self-attention casts its fp32 input to bf16 once (a pre-hook) instead of once per projection: the
    same forward values as autocast's own casts, gradients within bf16 rounding, nothing changed outside autocast."""
    from nmtcore.bert import BertLayer
    from nmtcore.bert.attention import _cast_once
    from nmtcore.config import BertConfig
    from nmtcore.testing.zoo import TINY_BERT

    layer = BertLayer(BertConfig(**{**TINY_BERT, "freeze": False})).eval()
    hooked = [m for m in layer.bert.modules() if _cast_once in [h for h in m._forward_pre_hooks.values()]]
    assert hooked and len(hooked) == layer.num_layers
    ids = torch.randint(5, layer.bert.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[2, 6:] = True

    def run(with_hook: bool):
        for m in hooked:
            m._forward_pre_hooks.clear()
            if with_hook:
                m.register_forward_pre_hook(_cast_once, with_kwargs=True)
        layer.bert.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer.run(ids, mask)[-1]
        out.float().square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in layer.bert.named_parameters() if p.grad is not None}

    (off, g_off), (on, g_on) = run(False), run(True)
    assert torch.equal(on, off)
    assert g_on.keys() == g_off.keys()
    scale = max(g.norm() for g in g_off.values())  # the keys' bias has a gradient of 0 up to rounding
    for name, g in g_on.items():  # bf16 rounding of the summed gradient: relative to the whole tensor
        assert (g - g_off[name]).norm() <= 0.01 * g_off[name].norm() + 1e-6 * scale, name
    with torch.no_grad():  # outside autocast: fp32 throughout, the hook does nothing
        torch.testing.assert_close(layer.run(ids, mask)[-1], layer.run(ids, mask)[-1])
        assert layer.run(ids, mask)[-1].dtype == torch.float32


# One tiny case per model class (variants share their class's code): what ``train.compile`` compiles.
COMPILED_CASES = ["transformer", "bert_fused", "bert_jam", "mask_fusion", "doc_context", "plm_sponsored"]


def test_the_compiled_cases_cover_every_model_class():
    assert {type(tiny_model(case)) for case in COMPILED_CASES} == set(MODEL_CLASSES.values())


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_model_gives_the_eager_loss_and_gradients(case, small_batch):
    """torch.compile (inductor, dynamic shapes, as ``train.compile``) vs eager on a fixed batch in bf16
    autocast: the same loss and gradients within bf16 tolerance (eval mode: no dropout draws to differ);
    incremental decoding, which stays eager, still equals teacher forcing afterwards."""
    model = tiny_model(case).eval()
    batch = with_inputs(model, small_batch)
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True)
    results = []
    for module in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = label_smoothed_nll(module(batch).logits, batch.tgt_out, 0.1, PAD).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    (eager, g_eager), (comp, g_comp) = results
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert comp == pytest.approx(eager, rel=1e-2)
    assert g_comp.keys() == g_eager.keys() and g_eager
    # bf16 tolerance for gradients: direction and size per tensor, not each element (a reduction over many
    # bf16 terms, like a GLU weight's gradient, moves by several percent with the order of summation). A
    # gradient that is zero up to rounding (attention key biases: softmax ignores a constant per row) is noise
    # on both sides: it must stay that small.
    scale = max(g.norm().item() for g in g_eager.values())
    for name, g in g_eager.items():
        if g.norm() < 1e-3 * scale:
            assert g_comp[name].norm() < 1e-2 * scale, name
            continue
        cos = torch.nn.functional.cosine_similarity(g_comp[name].flatten(), g.flatten(), dim=0, eps=1e-12)
        assert cos > 0.99, (name, cos)
        assert g_comp[name].norm() == pytest.approx(g.norm().item(), rel=0.1, abs=1e-8), name
    with torch.no_grad():
        full = model(batch).logits
        enc = model.encode(batch)
        state = model.init_state(enc)
        steps = [model.decode_step(batch.tgt_in[:, t : t + 1], enc, state) for t in range(batch.tgt_in.size(1))]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)
