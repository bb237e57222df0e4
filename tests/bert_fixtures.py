"""Tiny random BERTs saved to disk (the real ``from_pretrained`` path) and an NMT vocabulary to align with.

The vocabulary holds the pieces of the tricky words the alignment tests use (punctuation, numbers, a
German compound split into many WordPieces) plus the synthetic corpus' source words, so a tiny BERT reads
``tests/synthetic.py`` text without turning it all into ``[UNK]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.synthetic import SRC_WORDS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDPIECES = ["zwei", "hunde", ",", "1", "000", "don", "##au", "##dampf", "##schiff", "##e", "lauf", "##en", ".",
              "two", "dogs", "run", "a", "dog", "the", "man", "is", "!", "?"] + SRC_WORDS
TRICKY_LINE = "Zwei Hunde, 1,000 Donaudampfschiffe 😀 laufen."


def save_tiny_bert(path: Path, layers: int = 2, hidden: int = 64, heads: int = 2, max_positions: int = 64,
                   seed: int = 0, words: list[str] | None = None) -> Path:
    """Write a random ``BertModel`` + WordPiece tokenizer to ``path`` with ``save_pretrained``."""
    import torch
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
    from nmtcore.bert_pretrain import PretrainSpec, root_dir

    spec = PretrainSpec(layers, hidden, corpus, lang)
    path = root_dir(cache_dir) / spec.dirname / ("f" * 16)
    save_tiny_bert(path, layers=layers, hidden=hidden, **bert_kw)
    (path / "meta.json").write_text(json.dumps({"name": spec.name, "metrics": {}}), encoding="utf-8")
    return path
