"""The explicit model registry: one dict from model name to (config class, model class).

No decorators fill it by import side effect: a name missing here is an error at config time, so a run
labelled X can never silently train Y.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmtcore.config import ModelConfig
from nmtcore.models.base import DecoderState, EncoderOut, LayerCache, ModelOutput, NMTModel
from nmtcore.models.bert_fused import BertFused, BertFusedConfig
from nmtcore.models.bert_jam import BertJam, BertJamConfig, BertJamM1Config, BertJamM2Config, BertJamM3Config
from nmtcore.models.plm_sponsored import PlmSponsored, PlmSponsoredConfig
from nmtcore.models.doc_context import DocContext, DocContextConfig
from nmtcore.models.mask_fusion import (MaskFusion, MaskFusionConfig, MaskFusionM1Config, MaskFusionM2Config,
                                       MaskFusionM3Config)
from nmtcore.models.transformer import Transformer

if TYPE_CHECKING:
    from nmtcore.config import ExperimentConfig
    from nmtcore.data import PreparedData

MODEL_REGISTRY: dict[str, tuple[type[ModelConfig], type[NMTModel]]] = {
    "transformer": (ModelConfig, Transformer),
    "bert_fused": (BertFusedConfig, BertFused),
    "bert_jam": (BertJamConfig, BertJam),
    # BERT-JAM's ablations (Table 7): the same model class, configs whose defaults are the variant's fields.
    "bert_jam_m1": (BertJamM1Config, BertJam),
    "bert_jam_m2": (BertJamM2Config, BertJam),
    "bert_jam_m3": (BertJamM3Config, BertJam),
    "plm_sponsored": (PlmSponsoredConfig, PlmSponsored),
    "mask_fusion": (MaskFusionConfig, MaskFusion),
    # Mask fusion's ablations (Table 4): M1 last BERT layer, M2 no mask matrix, M3 no adaptive fusion.
    "mask_fusion_m1": (MaskFusionM1Config, MaskFusion),
    "mask_fusion_m2": (MaskFusionM2Config, MaskFusion),
    "mask_fusion_m3": (MaskFusionM3Config, MaskFusion),
    "doc_context": (DocContextConfig, DocContext),  # BERT as document-level context encoder (seed 003)
}


def prepare_model_resources(cfg: "ExperimentConfig", data: "PreparedData") -> "ExperimentConfig":
    """Run the model class's own preprocessing, if it declares one (``prepare(cfg, data) -> cfg``: e.g. the
    PLM-sponsored model's target BERT and FWET table), before the model is built. Idempotent and cached by
    the class; other models return ``cfg`` unchanged."""
    _, model_cls = MODEL_REGISTRY[cfg.model.name]
    prepare = getattr(model_cls, "prepare", None)
    return prepare(cfg, data) if prepare is not None else cfg


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> NMTModel:
    """Instantiate the registered model class for ``cfg.name``."""
    _, model_cls = MODEL_REGISTRY[cfg.name]
    return model_cls(cfg, vocab_size=vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)


__all__ = ["MODEL_REGISTRY", "build_model", "prepare_model_resources", "DecoderState", "EncoderOut", "LayerCache", "ModelOutput", "NMTModel"]
