"""The explicit model registry: each family's config class (:data:`nmtcore.config.MODEL_CONFIGS`, keyed by
``model.name``) → the model class built from it.

No decorators fill it by import side effect: a config class missing here is an error at build time, and
``tests/test_model_contract.py`` checks that every registered name has a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmtcore.config import (MODEL_CONFIGS, BertFusedConfig, BertJamConfig, DocContextConfig, MaskFusionConfig,
                            ModelConfig, PlmSponsoredConfig)
from nmtcore.models.base import NMTModel
from nmtcore.models.bert_fused import BertFused
from nmtcore.models.bert_jam import BertJam
from nmtcore.models.doc_context import DocContext
from nmtcore.models.mask_fusion import MaskFusion
from nmtcore.models.plm_sponsored import PlmSponsored
from nmtcore.models.transformer import Transformer

if TYPE_CHECKING:
    from nmtcore.config import ExperimentConfig
    from nmtcore.data import PreparedData

# A config class and its subclasses (the named ablation variants, e.g. BertJamM1Config) build the model
# class registered for the nearest class in their MRO.
MODEL_CLASSES: dict[type[ModelConfig], type[NMTModel]] = {
    ModelConfig: Transformer,
    BertFusedConfig: BertFused,
    BertJamConfig: BertJam,
    MaskFusionConfig: MaskFusion,
    DocContextConfig: DocContext,
    PlmSponsoredConfig: PlmSponsored,
}


def model_class(cfg: ModelConfig) -> type[NMTModel]:
    """The model class of a model config (its own class, else the nearest registered base)."""
    if MODEL_CONFIGS.get(cfg.name) is not type(cfg):
        raise TypeError(f"model config {type(cfg).__name__} is not the one registered for {cfg.name!r}")
    for cls in type(cfg).__mro__:
        if cls in MODEL_CLASSES:
            return MODEL_CLASSES[cls]
    raise TypeError(f"no model class is registered for {type(cfg).__name__}")  # pragma: no cover


def prepare_model_resources(cfg: "ExperimentConfig", data: "PreparedData") -> "ExperimentConfig":
    """The model class's own preprocessing (:meth:`NMTModel.prepare`) before the model is built."""
    return model_class(cfg.model).prepare(cfg, data)


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> NMTModel:
    """Instantiate the registered model class for ``cfg``."""
    return model_class(cfg)(cfg, vocab_size=vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
