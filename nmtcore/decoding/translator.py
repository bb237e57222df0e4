"""Translating: a whole split with any model (what validation and testing use), and raw sentences with a
trained checkpoint (``nmtcore translate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from nmtcore.allocator import tune_allocator
from nmtcore.bert import bert_layers, word_start_table
from nmtcore.checkpoint import CheckpointError, load_checkpoint, load_model_weights
from nmtcore.config import ConfigError, DecodeConfig, ExperimentConfig
from nmtcore.data import EncodedSplit, SubwordVocab, encode_split, inference_batches
from nmtcore.decoding import beam_search
from nmtcore.devices import default_device
from nmtcore.models import NMTModel, build_model


def translate_split(model: NMTModel, split: EncodedSplit, vocab: Any, dcfg: DecodeConfig,
                    device: torch.device) -> list[str]:
    """Beam (or greedy, beam 1) decode every sentence of ``split``; detokenized, in corpus order."""
    model.eval()
    batches = (b.to(device) for b in inference_batches(split, vocab, dcfg.sentences_per_batch(device)))
    results = beam_search.translate(model, batches, dcfg)
    return [vocab.decode(results[i][0].tokens) for i in range(len(split.src))]


class Translator:
    """A model + its vocabulary + decoding config, ready to translate lists of raw sentences."""

    def __init__(self, model: NMTModel, vocab: SubwordVocab, cfg: ExperimentConfig,
                 device: torch.device | None = None) -> None:
        tune_allocator()  # a decoding process: each beam step frees and reallocates its (rows × vocabulary) tensors
        self.device = device or default_device()
        self.model = model.to(self.device).eval()
        self.vocab, self.cfg = vocab, cfg

    def translate(self, lines: list[str]) -> list[str]:
        split = encode_split(self.vocab, "input", [" ".join(line.split()) for line in lines])
        for bert in bert_layers(self.model)[:1]:  # a BERT-consuming model reads its own stream of the input
            split.bert = bert.encode_split(split, word_start_table(self.vocab))
        return translate_split(self.model, split, self.vocab, self.cfg.decode, self.device)


def load_translator(path: Path, overrides: Mapping[str, Any] | None = None) -> Translator:
    """Rebuild the model from the checkpoint's own config through the registry and load its weights."""
    ckpt = load_checkpoint(path)
    missing = [k for k in ("config", "vocab", "model") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a model checkpoint of this project (no {', '.join(missing)})")
    try:
        cfg = ExperimentConfig.from_dict(ckpt["config"])
    except ConfigError as e:  # e.g. written by a newer version with keys this one does not know
        raise CheckpointError(f"{path}: its config does not load here: {e}") from None
    if overrides:
        cfg = cfg.with_overrides(overrides)
    vocab = SubwordVocab.from_tensor_payload(ckpt["vocab"])
    model = build_model(cfg.model, len(vocab), vocab.pad_id, vocab.bos_id, vocab.eos_id)
    load_model_weights(model, ckpt["model"], str(path))
    return Translator(model, vocab, cfg)
