"""Typed, frozen, validated experiment configuration (see :mod:`nmtcore.config.experiment`)."""

from nmtcore.config.experiment import SPEED_ONLY_KEYS, ExperimentConfig, flatten, nest, parse_overrides
from nmtcore.config.families import (BERT_JAM_ABLATIONS, MASK_FUSION_ABLATIONS, MODEL_CONFIGS, BertFusedConfig,
                                     BertJamConfig, BertJamM1Config, BertJamM2Config, BertJamM3Config,
                                     DocContextConfig, MaskFusionConfig, MaskFusionM1Config, MaskFusionM2Config,
                                     MaskFusionM3Config, PlmSponsoredConfig)
from nmtcore.config.presets import PRESETS, preset
from nmtcore.config.sections import (BertConfig, ConfigError, DataConfig, DecodeConfig, ModelConfig, PhaseConfig,
                                     TrainConfig, check, check_unit_interval)

__all__ = ["BERT_JAM_ABLATIONS", "SPEED_ONLY_KEYS", "BertConfig", "BertFusedConfig", "BertJamConfig", "BertJamM1Config", "BertJamM2Config",
           "BertJamM3Config", "ConfigError", "DataConfig", "DecodeConfig", "DocContextConfig", "ExperimentConfig",
           "MASK_FUSION_ABLATIONS", "MODEL_CONFIGS", "MaskFusionConfig", "MaskFusionM1Config", "MaskFusionM2Config",
           "MaskFusionM3Config", "ModelConfig", "PRESETS", "PhaseConfig", "PlmSponsoredConfig", "TrainConfig", "check",
           "check_unit_interval", "flatten", "nest", "parse_overrides", "preset"]
