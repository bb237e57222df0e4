"""Translating: a whole split with any model (what validation and testing use), and raw sentences with a
trained checkpoint (``nmtcore translate``)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from nmtcore.allocator import tune_allocator
from nmtcore.bert import bert_layers, word_start_table
from nmtcore.bert.features import FeatureCache
from nmtcore.checkpoint import CheckpointError, load_checkpoint, load_model_weights
from nmtcore.config import ConfigError, DecodeConfig, ExperimentConfig
from nmtcore.data import EncodedSplit, SubwordVocab, encode_split, inference_batches
from nmtcore.decoding import beam_search
from nmtcore.devices import default_device
from nmtcore.models import NMTModel, build_model

log = logging.getLogger("nmtcore.decoding")


def translate_split(model: NMTModel, split: EncodedSplit, vocab: Any, dcfg: DecodeConfig,
                    device: torch.device) -> list[str]:
    """Beam (or greedy, beam 1) decode every sentence of ``split``; detokenized, in corpus order. A source
    longer than the model can position is truncated to fit, with a warning naming its line; every other
    line is translated as it is."""
    model.eval()
    split = fit_to_positions(split, model.max_positions)
    batches = (b.to(device) for b in inference_batches(split, vocab, dcfg.sentences_per_batch(device)))
    results = beam_search.translate(model, batches, dcfg)
    return [vocab.decode(results[i][0].tokens) for i in range(len(split.src))]


def fit_to_positions(split: EncodedSplit, max_positions: int | None) -> EncodedSplit:
    """``split`` with every source longer than ``max_positions`` (its EOS included) cut to fit, each named in a
    warning (line numbers from 1, in ``split``'s order); ``split`` itself when all fit."""
    if not max_positions:
        return split
    long = np.flatnonzero(split.src_lens + 1 > max_positions)  # (K,)
    if not len(long):
        return split
    src = list(split.src)
    align = list(split.bert.align) if split.bert is not None else None
    for i in long:
        log.warning("%s line %d: %d subwords, more than the model's %d positions hold: translated from its first %d",
                    split.name, i + 1, len(src[i]), max_positions, max_positions - 1)
        src[i] = src[i][: max_positions - 1]
        if align is not None:  # the kept tokens' WordPiece spans, then EOS's (empty) one
            align[i] = np.concatenate([align[i][: max_positions - 1], align[i][-1:]])
    bert = dataclasses.replace(split.bert, align=align) if split.bert is not None else None
    return dataclasses.replace(split, src=src, bert=bert)


class Translator:
    """A model + its vocabulary + decoding config, ready to translate lists of raw sentences."""

    def __init__(self, model: NMTModel, vocab: SubwordVocab, cfg: ExperimentConfig,
                 device: torch.device | None = None) -> None:
        tune_allocator()  # a decoding process: each beam step frees and reallocates its (rows × vocabulary) tensors
        self.device = device or default_device()
        self.model = model.to(self.device).eval()
        self.vocab, self.cfg = vocab, cfg

    def translate(self, lines: list[str]) -> list[str]:
        """Translate raw source lines (whitespace normalised) with the configured search; one output each."""
        split = encode_split(self.vocab, "input", [" ".join(line.split()) for line in lines])
        for bert in bert_layers(self.model)[:1]:  # a BERT-consuming model reads its own stream of the input
            split.bert = bert.encode_split(split, word_start_table(self.vocab))
            if bert.cache_wanted:  # where this very input was cached (a test set), the states its run decoded from
                cache = FeatureCache(self.cfg.data.resolved_cache_dir() / "bert_features")
                split.bert.features = cache.load(bert.features_key(split.bert), len(lines))
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
