"""Frequency-weighted embedding transformation (FWET, PLM-sponsored NMT, Algorithm 1): the NMT target
vocabulary's embedding table built from a target BERT's WordPiece embeddings, weighted by how often each NMT
subword co-occurs with each WordPiece in the training text.

A preprocessing step: run it once per (vocabulary, target BERT, corpus) and point ``model.fwet`` at the file
(:func:`build_fwet` caches it, :func:`prepare_fwet` does both for a config). Token identity (Algorithm 1
lines 6 and 9) compares spellings: a SentencePiece piece ``▁Hund`` is spelled ``hund`` (the BERT's
normaliser, e.g. lowercasing), a continuation piece ``e`` is ``##e``; the softmax of line 27 runs over the
WordPieces an NMT subword co-occurred with (never over the whole WordPiece vocabulary); NMT subwords never
seen keep their random init; pad / unk / bos / eos take [PAD] / [UNK] / [CLS] / [SEP].
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Sequence

import torch
from torch import Tensor

from nmtcore.bert import BertSpec, ResolvedBert, default_cache_dir, resolve_bert
from nmtcore.config import BertConfig, ExperimentConfig, PlmSponsoredConfig
from nmtcore.files import atomic_file

if TYPE_CHECKING:
    from nmtcore.data import PreparedData, SubwordVocab


def fwet_counts(pairs: Iterable[tuple[Sequence[Hashable], Sequence[Hashable]]],
                same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> dict[Hashable, dict[Hashable, float]]:
    """Algorithm 1, lines 1-25: ``dic^N`` from (NMT tokens, PLM tokens) of every sentence.

    Equal tokens are peeled off both ends (+1 each; first from the front, then from the back), and every
    remaining NMT token co-occurs with every remaining PLM token with weight ``w = len(S^P)/len(S^N)``.
    ``same(n, p)`` decides token identity (default ``==``). Returns ``{n: {p: count}}``.
    """
    dic: dict[Hashable, dict[Hashable, float]] = {}

    def add(n: Hashable, p: Hashable, w: float) -> None:
        row = dic.setdefault(n, {})
        row[p] = row.get(p, 0.0) + w

    for nmt, plm in pairs:
        n, p = list(nmt), list(plm)
        i, j, a, b = 0, len(n), 0, len(p)  # the windows n[i:j], p[a:b] still to match
        while i < j and a < b:
            if same(n[i], p[a]):  # lines 6-8
                add(n[i], p[a], 1.0)
                i, a = i + 1, a + 1
            elif same(n[j - 1], p[b - 1]):  # lines 9-11
                add(n[j - 1], p[b - 1], 1.0)
                j, b = j - 1, b - 1
            else:
                break
        if i == j or a == b:  # lines 16-18
            continue
        w = (b - a) / (j - i)  # line 19
        for x in n[i:j]:  # lines 20-24
            for y in p[a:b]:
                add(x, y, w)
    return dic


def fwet_softmax(dic: dict[Hashable, dict[Hashable, float]]) -> dict[Hashable, dict[Hashable, float]]:
    """Line 27's weights: for each NMT token, a softmax over the counts of the PLM tokens it co-occurred with."""
    out = {}
    for n, row in dic.items():
        keys = list(row)
        w = torch.softmax(torch.tensor([row[k] for k in keys], dtype=torch.float64), dim=0).tolist()
        out[n] = dict(zip(keys, w))
    return out


def fwet_matrix(weights: dict[int, dict[int, float]], plm_embeddings: Tensor, init: Tensor) -> Tensor:
    """Line 27: ``E^N(k) = Σ_p softmax(dic^N(k))_p · E^P(p)`` for every NMT id ``k`` in ``weights``; the
    other rows of ``init`` (V, H) are kept. plm_embeddings: (V_P, H). Returns (V, H) float32."""
    out = init.detach().clone().float()
    emb = plm_embeddings.detach().float()
    for k, row in weights.items():
        ids = torch.tensor(list(row), dtype=torch.long)
        w = torch.tensor(list(row.values()), dtype=torch.float32)
        out[k] = w @ emb[ids]  # (H,)
    return out


def wordpiece_spelling(piece: str, normalize: Callable[[str], str] = lambda s: s) -> str:
    """A SentencePiece piece spelled as a WordPiece: ``▁Hund`` → ``normalize("Hund")``, ``e`` → ``##e``;
    a bare ``▁`` stays ``▁`` (no WordPiece is spelled so)."""
    if piece.startswith("\u2581"):
        return normalize(piece[1:]) if len(piece) > 1 else piece
    return "##" + normalize(piece)


def fwet_from_corpus(vocab: "SubwordVocab", resolved: ResolvedBert, lines: Sequence[str],
                     init_std: float = 0.02, seed: int = 0) -> tuple[Tensor, int]:
    """FWET of ``vocab`` from the WordPiece embeddings of ``resolved`` over raw target ``lines``.

    Returns the (V, H) table and how many NMT subwords it covers (the rest keep a N(0, init_std) init).
    """
    tokenizer = resolved.load_tokenizer()
    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    normalize = normalizer.normalize_str if normalizer is not None else (lambda s: s)
    pieces = [vocab.sp.id_to_piece(i) for i in range(len(vocab))]
    spelling = [wordpiece_spelling(p, normalize) for p in pieces]

    def pairs() -> Iterable[tuple[list[int], list[tuple[int, str]]]]:
        nmt = vocab.encode_many(lines)
        for ids, enc in zip(nmt, backend.encode_batch(list(lines), add_special_tokens=False)):
            yield ids.tolist(), list(zip(enc.ids, enc.tokens))

    dic = fwet_counts(pairs(), same=lambda n, p: spelling[n] == p[1])
    weights: dict[int, dict[int, float]] = {n: {p[0]: w for p, w in row.items()}
                                           for n, row in fwet_softmax(dic).items()}
    specials = {vocab.pad_id: tokenizer.pad_token_id, vocab.bos_id: tokenizer.cls_token_id,
                vocab.eos_id: tokenizer.sep_token_id, vocab.sp.unk_id(): tokenizer.unk_token_id}
    for n, p in specials.items():
        if p is not None:
            weights[n] = {p: 1.0}
    plm = resolved.load_model().get_input_embeddings().weight  # (V_P, H)
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(len(vocab), plm.size(1), generator=gen) * init_std
    return fwet_matrix(weights, plm, init), len(weights)


def build_fwet(vocab: "SubwordVocab", tgt_bert: BertConfig, lines: Sequence[str],
               cache_dir: str | os.PathLike | None = None) -> Path:
    """The FWET table of ``vocab`` for ``tgt_bert`` over ``lines``, computed once and cached under
    ``cache_dir/fwet/<key>.pt`` (key: vocabulary checksum, BERT location and weight files, corpus)."""
    resolved = resolve_bert(BertSpec.from_config(tgt_bert), cache_dir=tgt_bert.cache_dir or None,
                            pretrain_corpus=tgt_bert.pretrain_corpus, pretrain_steps=tgt_bert.pretrain_steps)
    h = hashlib.sha256()
    h.update(json.dumps({"vocab": vocab.checksum, "bert": str(resolved.path), "algo": "fwet-v1"}).encode())
    for f in sorted(resolved.path.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    root = Path(cache_dir).expanduser().resolve() if cache_dir else default_cache_dir()
    path = root / "fwet" / f"{h.hexdigest()[:24]}.pt"
    if path.is_file():
        return path
    table, covered = fwet_from_corpus(vocab, resolved, lines)
    with atomic_file(path, suffix=".pt") as tmp:  # concurrent trials never read half a file
        torch.save({"embeddings": table, "covered": covered, "bert": str(resolved.spec), "vocab": vocab.checksum},
                   tmp)
    return path


def prepare_fwet(cfg: ExperimentConfig, data: "PreparedData") -> ExperimentConfig:
    """``cfg`` with ``model.fwet`` pointing at the FWET table of the training split's target side
    (cached; a no-op when ``model.fwet`` is already set). Call before building the model."""
    if not isinstance(cfg.model, PlmSponsoredConfig) or cfg.model.fwet:
        return cfg
    path = build_fwet(data.vocab, cfg.model.tgt_bert, data.train.raw_tgt, cfg.data.resolved_cache_dir())
    return replace(cfg, model=replace(cfg.model, fwet=str(path)))
