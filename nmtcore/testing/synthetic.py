"""A synthetic translation task the tests generate: a fixed word mapping plus local reordering.

Target = each source word mapped through a fixed dictionary, with every adjacent pair swapped
("a b c d e" → "B A D C E"). A model must learn both lexical mapping and reordering, unlike a copy task.
"""

from __future__ import annotations

import random
from pathlib import Path

SRC_WORDS = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "tu", "vo", "xe", "zi", "bo"]
TGT_WORDS = ["Hund", "Katze", "Baum", "Haus", "Auto", "Fisch", "Vogel", "Stern", "Mond", "Blatt", "Rad", "Tor"]
MAPPING = dict(zip(SRC_WORDS, TGT_WORDS))


def translate(words: list[str]) -> list[str]:
    """The synthetic task's reference translation: each word mapped, then neighbours swapped in pairs."""
    out = [MAPPING[w] for w in words]
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def write_corpus(root: Path, n_train: int = 3000, n_eval: int = 200, min_len: int = 3, max_len: int = 8,
                 seed: int = 0, src_lang: str = "xx", tgt_lang: str = "yy") -> Path:
    """Write ``{train,valid,test}.{src_lang,tgt_lang}`` under ``root``; returns ``root``."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_eval), ("test", n_eval)):
        src, tgt = [], []
        for _ in range(n):
            words = [rng.choice(SRC_WORDS) for _ in range(rng.randint(min_len, max_len))]
            src.append(" ".join(words))
            tgt.append(" ".join(translate(words)))
        (root / f"{split}.{src_lang}").write_text("\n".join(src) + "\n", encoding="utf-8")
        (root / f"{split}.{tgt_lang}").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return root


def tiny_experiment(tmp: Path, **overrides) -> "ExperimentConfig":  # noqa: F821
    """An ExperimentConfig for the synthetic corpus with a tiny fast model."""
    from nmtcore.config import ExperimentConfig

    data_dir = write_corpus(tmp / "data")
    base = {
        "name": "synthetic",
        "output_dir": str(tmp / "run"),
        "data": {"corpus": "parallel", "data_dir": str(data_dir), "src_lang": "xx", "tgt_lang": "yy",
                 "train_split": "train", "valid_split": "valid", "test_splits": ["test"], "vocab_size": 96,
                 "max_tokens": 600, "cache_dir": str(tmp / "cache")},
        "model": {"name": "transformer", "encoder_layers": 2, "decoder_layers": 2, "d_model": 64,
                  "ffn_dim": 128, "heads": 4, "dropout": 0.0},
        "train": {"lr": 3e-3, "warmup_updates": 50, "max_epochs": 2, "seed": 1, "log_interval": 10,
                  "precision": "fp32", "valid_bleu": False, "keep_last": 3},
        "decode": {"beam": 4, "max_sentences": 100},
    }
    return ExperimentConfig.from_dict(base).with_overrides(overrides)
