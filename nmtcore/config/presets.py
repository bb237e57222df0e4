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
    # PLM-sponsored NMT as its paper trains it on IWSLT'14 De→En (seed 001, Section 3.2-3.3): the coordinator
    # is Transformer-base (d 512, FFN 2048, 8 heads) with 12 layers; PLMs bert-base-uncased (En) and
    # dbmdz/bert-base-german-uncased (De), fine-tuned, hidden dropout 0.5; α = 0.9 (Eq. 5); Adam (0.9, 0.98,
    # ε 1e-9), lr 5e-4, 4000 warm-up updates from 1e-7, label smoothing 0.1, 4096-token batches, 100k updates.
    "plm_sponsored_iwslt_paper": {
        "name": "plm_sponsored_iwslt_paper",
        "data": {"corpus": "iwslt14", "src_lang": "de", "tgt_lang": "en", "valid_split": "valid",
                 "test_splits": ["test"], "vocab_size": 10000, "max_tokens": 4096},
        "model": {"name": "plm_sponsored", "decoder_layers": 12, "d_model": 512, "ffn_dim": 2048, "heads": 8,
                  "dropout": 0.1, "plm_dropout": 0.5,
                  "bert": {"name": "dbmdz/bert-base-german-uncased", "freeze": False},
                  "tgt_bert": {"name": "bert-base-uncased", "freeze": False}},
        "train": {"lr": 5e-4, "warmup_updates": 4000, "warmup_init_lr": 1e-7, "adam_betas": [0.9, 0.98],
                  "adam_eps": 1e-9, "label_smoothing": 0.1, "max_updates": 100000, "max_epochs": 1000,
                  "kd_alpha": 0.9},
        "decode": {"beam": 5},
    },
    # Its ablation setting (Section 4, WMT'14 En→De): the coordinator has 6 layers "to speed up the training",
    # 400k updates; PLMs bert-base-cased (En) and bert-base-german-cased (De) with the WMT hidden dropout 0.3;
    # lr 7e-4 with 8000 warm-up updates (Section 3.3, WMT). WMT'14 is not a registered corpus: point
    # data.data_dir at fairseq's prepare-wmt14en2de.sh output ({train,valid,test}.{en,de}).
    "plm_sponsored_ablation_paper": {
        "name": "plm_sponsored_ablation_paper",
        "data": {"corpus": "parallel", "src_lang": "en", "tgt_lang": "de", "valid_split": "valid",
                 "test_splits": ["test"], "vocab_size": 30000, "max_tokens": 4096},
        "model": {"name": "plm_sponsored", "decoder_layers": 6, "d_model": 512, "ffn_dim": 2048, "heads": 8,
                  "dropout": 0.1, "plm_dropout": 0.3,
                  "bert": {"name": "bert-base-cased", "freeze": False},
                  "tgt_bert": {"name": "bert-base-german-cased", "freeze": False}},
        "train": {"lr": 7e-4, "warmup_updates": 8000, "warmup_init_lr": 1e-7, "adam_betas": [0.9, 0.98],
                  "adam_eps": 1e-9, "label_smoothing": 0.1, "max_updates": 400000, "max_epochs": 1000,
                  "kd_alpha": 0.9},
        "decode": {"beam": 4, "lenpen": 0.6},
    },
}


def preset(name: str) -> ExperimentConfig:
    """The experiment config of preset ``name`` (a key of :data:`PRESETS`); one-line error naming the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return ExperimentConfig.from_dict(PRESETS[name])
