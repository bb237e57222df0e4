"""Tiny instances of every registered model and hand-built batches, for the shared contract tests and any
test that needs a model of a family without data on disk."""

from __future__ import annotations

from typing import Any

import torch

from nmtcore.config import MODEL_CONFIGS, ExperimentConfig
from nmtcore.data import Batch
from nmtcore.models import NMTModel, build_model
from nmtcore.testing.tiny_bert import add_bert_stream, tiny_bert_dir

PAD, BOS, EOS = 0, 2, 3
VOCAB = 40
TINY = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "ffn_dim": 64, "heads": 4, "dropout": 0.1}
# The tiny random BERT every BERT model reads in these tests (written once per machine).
TINY_BERT = {"name": tiny_bert_dir()}
# Per case: the model's registered name and the extra fields of its tiny instance. Every registered name is
# a case; variants cover switches that change the computation.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "transformer": ("transformer", {}),
    "transformer_prenorm": ("transformer", {"pre_norm": True}),
    "bert_fused": ("bert_fused", {"bert": TINY_BERT}),
    "bert_fused_pnet0": ("bert_fused", {"bert": TINY_BERT, "p_net": 0.0}),
    "bert_fused_finetune": ("bert_fused", {"bert": {**TINY_BERT, "freeze": False}}),
    "bert_jam": ("bert_jam", {"bert": TINY_BERT}),
    "bert_jam_m1": ("bert_jam_m1", {"bert": TINY_BERT}),
    "bert_jam_m2": ("bert_jam_m2", {"bert": TINY_BERT}),
    "bert_jam_m3": ("bert_jam_m3", {"bert": TINY_BERT}),
    "bert_jam_dropnet_finetune": ("bert_jam", {"bert": {**TINY_BERT, "freeze": False}, "decoder_p_net": 1.0}),
    "doc_context": ("doc_context", {"bert": TINY_BERT}),
    "doc_context_encoder": ("doc_context", {"bert": TINY_BERT, "context_integration": "encoder"}),
    "doc_context_decoder_prenorm": ("doc_context", {"bert": TINY_BERT, "context_integration": "decoder",
                                                    "pre_norm": True}),
    "doc_context_none": ("doc_context", {"bert": TINY_BERT, "context_integration": "none"}),
    "mask_fusion": ("mask_fusion", {"bert": TINY_BERT}),
    "mask_fusion_m1": ("mask_fusion_m1", {"bert": TINY_BERT}),
    "mask_fusion_m2": ("mask_fusion_m2", {"bert": TINY_BERT}),
    "mask_fusion_m3": ("mask_fusion_m3", {"bert": TINY_BERT}),
    "mask_fusion_theta1_finetune": ("mask_fusion", {"bert": {**TINY_BERT, "freeze": False}, "mask_threshold": 1.0}),
    # PLM-sponsored: fine-tuned source BERT, the tiny BERT as target BERT too; all losses on / all off.
    "plm_sponsored": ("plm_sponsored", {"bert": {**TINY_BERT, "freeze": False},
                                        "tgt_bert": {**TINY_BERT, "freeze": False}}),
    "plm_sponsored_plain_d48": ("plm_sponsored", {"bert": TINY_BERT, "tgt_bert": TINY_BERT, "d_model": 48,
                                                  "encoder_gate": False, "kd_teacher": False, "mlm_loss": False,
                                                  "tgt_lm_loss": False, "share_embeddings": False}),
}
assert set(MODEL_CONFIGS) <= {name for name, _ in CASES.values()}, "every registered model needs a tiny case"


def tiny_model(case: str, seed: int = 0) -> NMTModel:
    """The tiny instance of ``case`` (a key of :data:`CASES`), initialised from ``seed``."""
    torch.manual_seed(seed)
    name, fields = CASES[case]
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


def make_batch(src: list[list[int]], tgt: list[list[int]]) -> Batch:
    """A right-padded Batch from token lists (without bos/eos)."""

    def pad(rows: list[list[int]], prefix: list[int], suffix: list[int]) -> torch.Tensor:
        rows = [prefix + r + suffix for r in rows]
        width = max(len(r) for r in rows)
        t = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r)] = torch.tensor(r)
        return t

    s = pad(src, [], [EOS])
    ti, to = pad(tgt, [BOS], []), pad(tgt, [], [EOS])
    return Batch(src=s, src_mask=s.eq(PAD), tgt_in=ti, tgt_out=to, tgt_mask=to.eq(PAD),
                 ids=torch.arange(len(src)), extras={})


def with_inputs(model: NMTModel, batch: Batch) -> Batch:
    """``batch`` with the BERT stream a BERT-consuming model reads (unchanged for the others)."""
    return add_bert_stream(batch, PAD) if model.cfg.bert.enabled else batch
