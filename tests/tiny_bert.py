"""A tiny random BERT on disk (real ``from_pretrained`` path) and a BERT stream for hand-built batches.

The BERT is written once per machine to a temp directory keyed by its settings (written to a private
directory, then renamed into place, so concurrent test processes never see a half-written one).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from tests.bert_fixtures import SPECIALS, WORDPIECES, save_tiny_bert

BERT_VOCAB = len(SPECIALS) + len(WORDPIECES)
BERT_HIDDEN = 48  # differs from the tiny NMT d_model (32): exercises kdim != d_model
BERT_LAYERS = 2
CLS, SEP, BERT_PAD = 2, 3, 0


def tiny_bert_dir() -> str:
    """Directory of a 2-layer, width-48 random BertModel whose WordPiece vocabulary covers the synthetic
    corpus (:func:`tests.bert_fixtures.save_tiny_bert`), created once per machine."""
    root = Path(tempfile.gettempdir()) / f"nmtcore-tiny-bert-v2-L{BERT_LAYERS}-H{BERT_HIDDEN}-V{BERT_VOCAB}"
    if (root / "config.json").is_file() and (root / "model.safetensors").is_file():
        return str(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-bert-", dir=root.parent))
    save_tiny_bert(tmp, layers=BERT_LAYERS, hidden=BERT_HIDDEN, seed=1234)
    try:
        os.replace(tmp, root)
    except OSError:  # another process won the race: use its copy
        pass
    return str(root)


def add_bert_stream(batch, pad_id: int = 0):
    """Give a hand-built batch the ``bert_*`` extras :func:`nmtcore.data.collate_bert` would: per row,
    ``[CLS]`` + its non-pad source ids folded into the BERT vocabulary + ``[SEP]``, right-padded.

    Derived row by row, so a sentence gets the same BERT input alone or next to longer ones.
    """
    rows = [r[r.ne(pad_id)] % (BERT_VOCAB - 5) + 5 for r in batch.src]
    rows = [torch.cat([torch.tensor([CLS]), r, torch.tensor([SEP])]) for r in rows]
    tb = max(len(r) for r in rows)
    ids = torch.full((len(rows), tb), BERT_PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    mask = ids.eq(BERT_PAD)  # (B, Tb) True = padding
    S = batch.src.size(1)
    align = torch.zeros(len(rows), S, 2, dtype=torch.long)  # token i of the source ↔ WordPiece i + 1
    align[..., 0] = torch.arange(1, S + 1)
    align[..., 1] = torch.arange(2, S + 2)
    batch.extras = {**batch.extras, "bert_ids": ids, "bert_mask": mask,
                    "bert_segments": torch.zeros_like(ids), "bert_align": align}
    return batch
