"""The explicit model registry: one dict from model name to (config class, model class).

No decorators fill it by import side effect: a name missing here is an error at config time, so a run
labelled X can never silently train Y.
"""

from __future__ import annotations

from nmtcore.config import ModelConfig
from nmtcore.models.base import DecoderState, EncoderOut, LayerCache, ModelOutput, NMTModel
from nmtcore.models.bert_fused import BertFused, BertFusedConfig
from nmtcore.models.bert_jam import BertJam, BertJamConfig, BertJamM1Config, BertJamM2Config, BertJamM3Config
from nmtcore.models.transformer import Transformer

MODEL_REGISTRY: dict[str, tuple[type[ModelConfig], type[NMTModel]]] = {
    "transformer": (ModelConfig, Transformer),
    "bert_fused": (BertFusedConfig, BertFused),
    "bert_jam": (BertJamConfig, BertJam),
    # BERT-JAM's ablations (Table 7): the same model class, configs whose defaults are the variant's fields.
    "bert_jam_m1": (BertJamM1Config, BertJam),
    "bert_jam_m2": (BertJamM2Config, BertJam),
    "bert_jam_m3": (BertJamM3Config, BertJam),
}


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> NMTModel:
    """Instantiate the registered model class for ``cfg.name``."""
    _, model_cls = MODEL_REGISTRY[cfg.name]
    return model_cls(cfg, vocab_size=vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)


__all__ = ["MODEL_REGISTRY", "build_model", "DecoderState", "EncoderOut", "LayerCache", "ModelOutput", "NMTModel"]
