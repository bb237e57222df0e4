"""Tiny random BERTs saved to disk (the real ``from_pretrained`` path), a BERT stream for hand-built
batches, and places where a BERT of a given name resolves offline — for the tests and ``--smoke-test``.

The WordPiece vocabulary holds the pieces of the tricky words the alignment tests use (punctuation,
numbers, a German compound split into many WordPieces) plus the synthetic corpus' source words, so a tiny
BERT reads :mod:`nmtcore.testing.synthetic` text without turning it all into ``[UNK]``. The BERTs are
random: they exercise code paths, never a result.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from nmtcore.files import atomic_directory
from nmtcore.testing.synthetic import SRC_WORDS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDPIECES = ["zwei", "hunde", ",", "1", "000", "don", "##au", "##dampf", "##schiff", "##e", "lauf", "##en", ".",
              "two", "dogs", "run", "a", "dog", "the", "man", "is", "!", "?"] + SRC_WORDS
TRICKY_LINE = "Zwei Hunde, 1,000 Donaudampfschiffe 😀 laufen."


def save_tiny_bert(path: Path, layers: int = 2, hidden: int = 64, heads: int = 2, max_positions: int = 64,
                   seed: int = 0, words: list[str] | None = None) -> Path:
    """Write a random ``BertModel`` + WordPiece tokenizer to ``path`` with ``save_pretrained``."""
    from transformers import BertConfig, BertModel, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + (words or WORDPIECES)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    # transformers 5: `vocab=` (a path or a dict); a `vocab_file=` keyword is silently ignored.
    BertTokenizer(vocab=str(path / "vocab.txt")).save_pretrained(str(path))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=2 * hidden,
                                     max_position_embeddings=max_positions))
    model.save_pretrained(str(path))
    return path


def fake_hf_cache(root: Path, repo_id: str, source: Path, commit: str = "0" * 40) -> Path:
    """Lay ``source``'s files out as the Hugging Face hub cache would after a download of ``repo_id``."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    return snap


def fake_pretrained_here(cache_dir: Path, layers: int, hidden: int, corpus: str, lang: str, **bert_kw) -> Path:
    """A tiny BERT placed where ``pretrained-here:L{layers}-H{hidden}:{corpus}:{lang}`` resolves."""
    from nmtcore.bert.made_here import PretrainSpec, root_dir

    spec = PretrainSpec(layers, hidden, corpus, lang)
    path = root_dir(cache_dir) / spec.dirname / ("f" * 16)
    save_tiny_bert(path, layers=layers, hidden=hidden, **bert_kw)
    (path / "meta.json").write_text(json.dumps({"name": spec.name, "metrics": {}}), encoding="utf-8")
    return path


BERT_VOCAB = len(SPECIALS) + len(WORDPIECES)
BERT_HIDDEN = 48  # differs from the tiny NMT d_model (32): exercises kdim != d_model
BERT_LAYERS = 2
CLS, SEP, BERT_PAD = 2, 3, 0


def tiny_bert_dir() -> str:
    """Directory of a 2-layer, width-48 random BertModel whose WordPiece vocabulary covers the synthetic
    corpus (:func:`save_tiny_bert`), created once per machine."""
    root = Path(tempfile.gettempdir()) / f"nmtcore-tiny-bert-v2-L{BERT_LAYERS}-H{BERT_HIDDEN}-V{BERT_VOCAB}"
    if (root / "config.json").is_file() and (root / "model.safetensors").is_file():
        return str(root)
    with atomic_directory(root) as tmp:  # another process winning the race keeps its (identical) copy
        save_tiny_bert(tmp, layers=BERT_LAYERS, hidden=BERT_HIDDEN, seed=1234)
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
