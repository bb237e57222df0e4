"""Named starting points for experiments (``nmtcore train --preset NAME``)."""

from __future__ import annotations

from typing import Any

from nmtcore.config.experiment import ExperimentConfig
from nmtcore.config.sections import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # The papers' IWSLT'14 setting (transformer_iwslt_de_en): 6+6, d 512, FFN 1024, 4 heads, dropout 0.3.
    "transformer_iwslt_de_en": {
        "name": "transformer_iwslt_de_en",
        "data": {"corpus": "iwslt14", "src_lang": "de", "tgt_lang": "en", "valid_split": "valid",
                 "test_splits": ["test"], "vocab_size": 10000},
        "model": {"name": "transformer", "encoder_layers": 6, "decoder_layers": 6, "d_model": 512,
                  "ffn_dim": 1024, "heads": 4, "dropout": 0.3},
        "train": {"lr": 5e-4, "warmup_updates": 4000, "max_epochs": 50, "patience": 10},
    },
    # CPU-sized Multi30k En→De; the same model fairseq is benchmarked with (../shared/bench).
    "multi30k_small": {
        "name": "multi30k_small",
        "data": {"corpus": "multi30k", "src_lang": "en", "tgt_lang": "de", "vocab_size": 8000,
                 "max_tokens": 4096},
        "model": {"name": "transformer", "encoder_layers": 3, "decoder_layers": 3, "d_model": 256,
                  "ffn_dim": 1024, "heads": 4, "dropout": 0.1},
        "train": {"lr": 1e-3, "warmup_updates": 400, "max_epochs": 10},
    },
}


def preset(name: str) -> ExperimentConfig:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ExperimentConfig.from_dict(PRESETS[name])
