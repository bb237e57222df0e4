"""Small-BERT pretraining: how the L × H grid and a German BERT exist on a machine with no model hub.

``nmtcore bert-pretrain --layers 4 --hidden 256 --corpus multi30k --lang en`` trains a WordPiece
vocabulary with Hugging Face ``tokenizers`` on one side of a corpus' training split, then a
``transformers.BertForMaskedLM`` of that size with masked-LM (Devlin et al. 2019: 15 % of the WordPieces
chosen, 80 % of those replaced by ``[MASK]``, 10 % by a random WordPiece, 10 % kept), and reports MLM
accuracy on held-out text (the corpus' validation split, never trained on) next to the accuracy of
always guessing the most frequent WordPiece.

The result is a directory ``from_pretrained`` loads (config.json, model.safetensors, tokenizer files,
plus meta.json with the recipe and the metrics), named ``pretrained-here:L4-H256:multi30k:en`` and
cached by everything that changes it:

    <cache_dir>/bert/pretrained-here/<corpus>.<lang>/L{L}-H{H}.steps{S}.seed{seed}.v{vocab}.len{max_len}/<corpus sha256[:16]>/

It is written under a temporary name and renamed into place (a killed run leaves nothing a later run
would trust); concurrent pretrainings of the same BERT serialise on a lock and the second reuses the first.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from nmtcore.bert.made_here import PretrainSpec, root_dir
from nmtcore.bert.mlm import mlm_corrupt
from nmtcore.bert.wordpiece import WordPieceEncoder
from nmtcore.config import DataConfig
from nmtcore.data import DataError, batch_indices, corpus_file, get_corpus, read_lines
from nmtcore.devices import autocast, autocast_dtype
from nmtcore.files import build_directory_once, sha256_file

log = logging.getLogger("nmtcore.bert")

# The recipe (fixed; part of PRETRAIN_FORMAT): token-budget batches, AdamW, linear warmup then decay.
PRETRAIN_FORMAT = 1  # bump when the recipe below changes the result for the same spec
BATCH_TOKENS = 4096
PEAK_LR = 1e-3
WARMUP_FRACTION = 0.06
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4



@dataclass
class PretrainResult:
    """Where a made-here BERT is, its name, its held-out figures, and whether it came from the cache."""

    path: Path
    name: str
    metrics: dict[str, float]
    cached: bool


def pretrain_bert(spec: PretrainSpec, data_cfg: DataConfig, threads: int | None = None, force: bool = False,
                  progress: Callable[[str], None] | None = None) -> PretrainResult:
    """Pretrain ``spec`` (or reuse the cached result) and return where it is.

    ``data_cfg`` says where corpora are read from and where the cache is (its ``corpus`` is replaced by
    ``spec.corpus``; its ``valid_split`` is the held-out text if that corpus has it).
    """
    cfg = replace(data_cfg, corpus=spec.corpus)
    get_corpus(spec.corpus)
    train_path = corpus_file(cfg, "train", spec.lang)
    checksum = sha256_file(train_path)
    final = root_dir(cfg.resolved_cache_dir()) / spec.dirname / checksum[:16]
    made: dict[str, dict] = {}

    def make(tmp: Path) -> None:  # concurrent pretrainings of one BERT: the second reuses the first's
        threads_before = torch.get_num_threads()
        try:
            if threads:
                torch.set_num_threads(threads)
            with torch.random.fork_rng():  # the caller's RNG (e.g. its model init) stays untouched
                made["meta"] = _pretrain(spec, cfg, train_path, checksum, tmp, progress or log.info)
            (tmp / "meta.json").write_text(json.dumps(made["meta"], indent=1) + "\n", encoding="utf-8")
        finally:
            torch.set_num_threads(threads_before)

    if not build_directory_once(final, make, force=force):  # --force replaces an old result
        return _cached(final, spec)
    meta = made["meta"]
    return PretrainResult(final, spec.name, meta["metrics"], cached=False)


def _cached(path: Path, spec: PretrainSpec) -> PretrainResult:
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    return PretrainResult(path, spec.name, meta["metrics"], cached=True)


def _heldout(cfg: DataConfig, lang: str, train: list[str]) -> tuple[list[str], list[str], str]:
    """(training lines, held-out lines, where the held-out text comes from)."""
    corpus = get_corpus(cfg.corpus)
    for split in dict.fromkeys([cfg.valid_split, "val", "valid", "dev"]):
        if corpus.splits and split not in corpus.splits:
            continue
        try:
            return train, read_lines(corpus_file(cfg, split, lang)), f"{cfg.corpus} {split}.{lang}"
        except DataError:
            continue
    n = max(1, min(1000, len(train) // 50))  # no validation split: hold out the training split's tail
    return train[:-n], train[-n:], f"last {n} lines of {cfg.corpus} train.{lang} (not trained on)"


def _train_wordpiece(lines: list[str], vocab_size: int) -> Any:
    """A lowercasing, accent-keeping WordPiece vocabulary (accents matter for German) as a
    ``transformers.BertTokenizer``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from tokenizers.trainers import WordPieceTrainer
    from transformers import BertTokenizer

    wp = Tokenizer(WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                               lowercase=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.train_from_iterator(lines, WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                                   min_frequency=2, show_progress=False))
    return BertTokenizer(vocab=wp.get_vocab(), do_lower_case=True, strip_accents=False, model_max_length=10**6)


def _pad(seqs: list[np.ndarray], idx: np.ndarray) -> torch.Tensor:
    T = max(len(seqs[i]) for i in idx)
    out = np.zeros((len(idx), T), dtype=np.int64)  # [PAD] = 0
    for b, i in enumerate(idx):
        out[b, : len(seqs[i])] = seqs[i]
    return torch.from_numpy(out)


def _pretrain(spec: PretrainSpec, cfg: DataConfig, train_path: Path, checksum: str, out: Path,
              progress: Callable[[str], None]) -> dict[str, Any]:
    import tokenizers
    import transformers
    from transformers import BertConfig as HFBertConfig, BertForMaskedLM

    t0 = time.perf_counter()
    lines = [line for line in read_lines(train_path) if line]
    train_lines, heldout_lines, heldout_from = _heldout(cfg, spec.lang, lines)
    tokenizer = _train_wordpiece(train_lines, spec.vocab_size)
    V = len(tokenizer)
    enc = WordPieceEncoder(tokenizer, spec.max_length)
    train_ids, held_ids = enc.encode(train_lines).ids, enc.encode(heldout_lines).ids
    lens = np.fromiter((len(s) for s in train_ids), dtype=np.int64, count=len(train_ids))
    progress(f"pretraining {spec.name}: WordPiece vocabulary of {V} on {len(train_lines)} lines of {train_path} "
             f"({time.perf_counter() - t0:.1f} s); held-out text: {heldout_from}")

    torch.manual_seed(spec.seed)
    config = HFBertConfig(vocab_size=V, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                          num_attention_heads=spec.hidden // 64, intermediate_size=4 * spec.hidden,
                          max_position_embeddings=spec.max_length, type_vocab_size=2, pad_token_id=0)
    model = BertForMaskedLM(config)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.98), eps=1e-6)
    warmup = max(1, int(WARMUP_FRACTION * spec.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (spec.steps - s) / max(1, spec.steps - warmup))))
    amp = autocast_dtype("auto", "cpu")
    g = torch.Generator().manual_seed(spec.seed)
    special_ids = torch.tensor([tokenizer.convert_tokens_to_ids(t) for t in SPECIALS])
    mask_id = tokenizer.mask_token_id

    def mlm_loss(ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        special = torch.isin(ids, special_ids)
        corrupted, chosen = mlm_corrupt(ids, special, mask_id, V, generator=gen, first_regular_id=len(SPECIALS))
        gold = ids[chosen]
        with autocast(amp, "cpu"):
            h = model.bert(input_ids=corrupted, attention_mask=(ids != 0).long()).last_hidden_state  # (B, T, H)
            logits = model.cls(h[chosen])  # (N, V): the MLM head only where a prediction is scored
        return F.cross_entropy(logits.float(), gold, reduction="sum"), logits.argmax(-1), gold

    model.train()
    step, epoch, loss_sum, n_sum = 0, 0, 0.0, 0
    t_train, cpu_train = time.perf_counter(), time.process_time()
    while step < spec.steps:
        epoch += 1
        for idx in batch_indices(lens - 1, lens - 1, BATCH_TOKENS, shuffle=True, seed=spec.seed, epoch=epoch):
            loss, _, gold = mlm_loss(_pad(train_ids, idx), g)
            (loss / len(gold)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            loss_sum, n_sum = loss_sum + loss.item(), n_sum + len(gold)
            if step % 100 == 0 or step == spec.steps:
                progress(f"step {step}/{spec.steps} epoch {epoch} mlm_loss {loss_sum / n_sum:.3f} "
                         f"({time.perf_counter() - t_train:.0f} s)")
                train_loss, loss_sum, n_sum = loss_sum / n_sum, 0.0, 0
            if step >= spec.steps:
                break

    metrics = _evaluate(mlm_loss, held_ids, train_ids, special_ids, model)
    metrics.update(train_mlm_loss=train_loss, train_wall_s=time.perf_counter() - t_train,
                   train_cpu_s=time.process_time() - cpu_train, total_wall_s=time.perf_counter() - t0,
                   epochs=float(epoch))
    progress(f"held-out MLM accuracy {metrics['heldout_mlm_accuracy']:.4f} (most-frequent-WordPiece baseline "
             f"{metrics['unigram_baseline_accuracy']:.4f}) on {int(metrics['heldout_predictions'])} masked "
             f"WordPieces of {heldout_from}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"name": spec.name, "spec": spec.__dict__, "format": PRETRAIN_FORMAT, "corpus_file": str(train_path),
            "corpus_sha256": checksum, "train_sentences": len(train_lines), "heldout": heldout_from,
            "heldout_sentences": len(heldout_lines), "vocab_size": V, "metrics": metrics,
            "recipe": {"batch_tokens": BATCH_TOKENS, "peak_lr": PEAK_LR, "warmup_fraction": WARMUP_FRACTION,
                       "mask": "15% chosen; 80/10/10 [MASK]/random/kept", "precision": str(amp or "fp32")},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
            "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


@torch.no_grad()
def _evaluate(mlm_loss: Callable, held_ids: list[np.ndarray], train_ids: list[np.ndarray],
              special_ids: torch.Tensor, model: torch.nn.Module) -> dict[str, float]:
    """MLM accuracy on the held-out text (fixed corruption, seed 1234) and the most-frequent-WordPiece
    baseline on the same positions."""
    model.eval()
    flat = np.concatenate(train_ids)
    counts = np.bincount(flat[~np.isin(flat, special_ids.numpy())])
    most_frequent = int(counts.argmax())
    g = torch.Generator().manual_seed(1234)
    lens = np.fromiter((len(s) for s in held_ids), dtype=np.int64, count=len(held_ids))
    correct = base = n = 0
    loss_sum = 0.0
    for idx in batch_indices(lens - 1, lens - 1, BATCH_TOKENS, shuffle=False):
        loss, pred, gold = mlm_loss(_pad(held_ids, idx), g)
        correct += int((pred == gold).sum())
        base += int((gold == most_frequent).sum())
        n += len(gold)
        loss_sum += loss.item()
    model.train()
    return {"heldout_mlm_accuracy": correct / n, "unigram_baseline_accuracy": base / n,
            "heldout_mlm_loss": loss_sum / n, "heldout_mlm_ppl": math.exp(loss_sum / n),
            "heldout_predictions": float(n)}
