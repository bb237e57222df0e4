"""Contract tests every registered model must pass (STYLE: one suite for the whole zoo).

A new model registers a tiny config here; the first test fails if one is missing.
"""

from __future__ import annotations

import pytest
import torch

from nmtcore.checkpoint import load_checkpoint, save_checkpoint
from nmtcore.config import ExperimentConfig
from nmtcore.losses import label_smoothed_nll
from nmtcore.models import MODEL_REGISTRY, build_model
from tests.conftest import BOS, EOS, PAD, make_batch
from tests.tiny_bert import add_bert_stream, tiny_bert_dir

VOCAB = 40
TINY = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "ffn_dim": 64, "heads": 4, "dropout": 0.1}
# Per-model extra fields for a tiny instance (BERT models add their tiny BERT here).
TINY_BERT = {"name": tiny_bert_dir()}
TINY_MODEL_OVERRIDES: dict[str, dict] = {
    "transformer": {},
    "transformer_prenorm": {"pre_norm": True},
    "bert_fused": {"bert": TINY_BERT},
    "bert_fused_pnet0": {"bert": TINY_BERT, "p_net": 0.0},
    "bert_fused_finetune": {"bert": {**TINY_BERT, "freeze": False}},
    "bert_jam": {"bert": TINY_BERT},
    "bert_jam_m1": {"bert": TINY_BERT},
    "bert_jam_m2": {"bert": TINY_BERT},
    "bert_jam_m3": {"bert": TINY_BERT},
    "bert_jam_dropnet_finetune": {"bert": {**TINY_BERT, "freeze": False}, "decoder_p_net": 1.0},
    "doc_context": {"bert": TINY_BERT},
    "doc_context_encoder": {"bert": TINY_BERT, "context_integration": "encoder"},
    "doc_context_decoder_prenorm": {"bert": TINY_BERT, "context_integration": "decoder", "pre_norm": True},
    "doc_context_none": {"bert": TINY_BERT, "context_integration": "none"},
    "mask_fusion": {"bert": TINY_BERT},
    "mask_fusion_m1": {"bert": TINY_BERT},
    "mask_fusion_m2": {"bert": TINY_BERT},
    "mask_fusion_m3": {"bert": TINY_BERT},
    "mask_fusion_theta1_finetune": {"bert": {**TINY_BERT, "freeze": False}, "mask_threshold": 1.0},
    # PLM-sponsored: fine-tuned source BERT, the tiny BERT as target BERT too; all losses on / all off.
    "plm_sponsored": {"bert": {**TINY_BERT, "freeze": False}, "tgt_bert": {**TINY_BERT, "freeze": False}},
    "plm_sponsored_plain_d48": {"bert": TINY_BERT, "tgt_bert": TINY_BERT, "d_model": 48, "encoder_gate": False,
                                "kd_teacher": False, "mlm_loss": False, "tgt_lm_loss": False,
                                "share_embeddings": False},
}
CASES = {name: name for name in MODEL_REGISTRY} | {
    "doc_context_encoder": "doc_context", "doc_context_decoder_prenorm": "doc_context",
    "doc_context_none": "doc_context",
    "transformer_prenorm": "transformer", "bert_fused_pnet0": "bert_fused", "bert_fused_finetune": "bert_fused",
    "bert_jam_dropnet_finetune": "bert_jam",
    "mask_fusion_theta1_finetune": "mask_fusion",
    "plm_sponsored_plain_d48": "plm_sponsored"}


def tiny_model(case: str, seed: int = 0):
    torch.manual_seed(seed)
    name = CASES[case]
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, **TINY_MODEL_OVERRIDES[case]}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


def with_inputs(model, batch):
    """``batch`` with the BERT stream a BERT-consuming model reads (unchanged for the others)."""
    return add_bert_stream(batch, PAD) if model.cfg.bert.enabled else batch


def test_every_registered_model_has_a_tiny_config():
    assert set(MODEL_REGISTRY) <= set(TINY_MODEL_OVERRIDES)


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
