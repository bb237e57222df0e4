"""Beam search and greedy search over the :class:`~nmtcore.models.base.NMTModel` interface.

One search serves every model: it only calls ``model.encode``, ``model.init_state``,
``model.decode_step`` and the ``reorder`` methods of :class:`EncoderOut` / :class:`DecoderState`.

Semantics follow fairseq's ``SequenceGenerator`` (``BeamSearch`` + ``normalize_scores``):

- log-probs are ``log_softmax`` of the logits in float32 (one fused pass per step) for the
  whole vocabulary; pad (and bos, unless it is eos) are never generated; NaNs become -inf;
- EOS is forbidden before ``min_len`` tokens; at step ``max_len = int(max_len_a * src_len + max_len_b)``
  only EOS is allowed (``src_len`` = non-pad source tokens, per sentence). Where ``max_len < min_len``
  the forced EOS wins, so every sentence gets a hypothesis;
- each step takes the top ``2 * beam`` candidates over (beam x vocab) cumulative log-probs; an EOS
  candidate among the first ``beam`` is finalised with score ``cum_logprob / (len + 1) ** lenpen``
  (``len + 1`` counts the EOS); the first ``beam`` non-EOS candidates continue;
- a sentence is done when it has ``beam`` finished hypotheses or reaches its ``max_len``.

Speed: the per-step path is vectorised over all sentences and beams; Python only runs on EOS events.
Each row's best ``2 * beam`` tokens come from :func:`topk_rows` (blocks' maxima, then topk within the best
blocks), and NaN is cleaned only when one reaches them.
Step 0 runs one row per sentence (all beams would be identical), and the expansion to ``beam`` rows is
just the first reorder. Finished sentences leave the batch: their rows are dropped from the decoder
state by the same ``reorder`` that follows the surviving beams. The encoder output and the caches' static
keys/values (encoder, BERT) stay one row per sentence (``NMTModel.beams_share_memory``; attention shares
each row with the sentence's beams): they change only when sentences leave, and then by the sentences'
index, where expanding them to every beam copied them at step 0 and again each time a sentence finished,
and scored each beam's query against its own copy. A model that sets it False gets them expanded to its
rows (reordered only when the set of sentences changes, the beams' rows being identical copies).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from nmtcore.config import DecodeConfig
from nmtcore.devices import autocast, autocast_dtype
from nmtcore.models import NMTModel


if TYPE_CHECKING:
    from nmtcore.data import Batch

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One finished translation.

    ``tokens``: target ids without bos/eos. ``score``: cumulative log-prob / (len(tokens) + 1) ** lenpen.
    ``positional_scores``: the log-prob of each token and of the final EOS (len(tokens) + 1 entries;
    their sum is the unnormalised score).
    """

    tokens: list[int]
    score: float
    positional_scores: list[float] = field(default_factory=list)


DecodeFn = Callable[[NMTModel, "Batch", DecodeConfig], "list[list[Hypothesis]]"]


# ---------------------------------------------------------------------- shared helpers
def max_lengths(src_mask: Tensor, cfg: DecodeConfig, max_positions: int | None = None) -> list[int]:
    """Per-sentence maximum number of target tokens before the forced EOS.

    ``int(max_len_a * src_len + max_len_b)`` with ``src_len`` the non-pad source tokens (final eos
    included), computed in Python floats exactly as fairseq does; never more than the decoder can position
    (``max_positions - 1``: BOS takes position 0), as fairseq caps it at the model's maximum positions.
    """
    src_len = (~src_mask).sum(dim=1).tolist()  # (B,)
    lengths = [int(cfg.max_len_a * n + cfg.max_len_b) for n in src_len]
    return [min(n, max_positions - 1) for n in lengths] if max_positions else lengths


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Decode without dropout, then give the model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _nan_to_neg_inf_(lprobs: Tensor) -> Tensor:
    """fairseq's rule, in place: NaN log-probs (from NaN/inf logits) become -inf."""
    return lprobs.nan_to_num_(nan=NEG_INF, posinf=math.inf, neginf=NEG_INF)


def _constrained_log_probs(
    logits: Tensor, model: NMTModel, step: int, min_len: int, forced: Tensor | None, clean_nan: bool = True
) -> Tensor:
    """Raw logits (R, V) -> fairseq's constrained float32 log-probs (R, V).

    ``log_softmax`` over the full vocabulary (one fused pass: 2x faster on CPU than logsumexp +
    subtract, measured at 640 x 8000), then pad, bos (unless it is eos) and the length constraints
    set to -inf; NaN (from NaN/inf logits) becomes -inf, as fairseq (``clean_nan=False`` leaves NaN: see
    :func:`_best_tokens`).
    ``forced``: (R,) bool, rows at their max length (only EOS allowed), or None when no row is.
    """
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (R, V)
    if clean_nan:
        _nan_to_neg_inf_(lprobs)
    lprobs[:, model.pad_id] = NEG_INF
    if model.bos_id != model.eos_id:
        lprobs[:, model.bos_id] = NEG_INF
    eos = model.eos_id
    eos_lprobs = lprobs[:, eos].clone() if forced is not None else None  # (R,)
    if step < min_len:
        lprobs[:, eos] = NEG_INF
    if forced is not None:
        lprobs.masked_fill_(forced.unsqueeze(1), NEG_INF)
        # max_len beats min_len: a forced row keeps its real EOS log-prob.
        lprobs[:, eos] = torch.where(forced, eos_lprobs, lprobs[:, eos])
    return lprobs


_CHUNK = 64  # vocabulary entries per block of :func:`topk_rows`' first pass


def topk_rows(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=1)`` for (R, V) rows with V much larger than k: values (R, k) best first, indices (R, k).

    On the CPU in two light passes: the maximum of every block of 64 entries (a vectorised reduction), then
    topk over the entries of the k blocks with the largest maxima (and the last, partial block). Those
    blocks hold k largest values: a block outside them is outranked by k block maxima at least as large as any
    of its entries. The CPU's topk copies each row into (value, index) pairs before selecting: over a beam-5
    step's 640 rows × 8000 tokens that was 12% of a decode's CPU time (torch profiler, 2 threads), as much as all
    its attention products. Where several entries tie at the k-th value, which of them is returned is not
    specified (as for ``topk``). Elsewhere, or for short rows, ``topk`` itself. NaN ranks above every number, as
    in ``topk``.
    """
    if k == 1:  # one pass already
        best, idx = x.max(dim=1)
        return best.unsqueeze(1), idx.unsqueeze(1)
    rows, v = x.shape
    blocks = v // _CHUNK
    if x.device.type != "cpu" or blocks < 4 * k or not x.is_contiguous():
        return x.topk(k, dim=1)
    top_blocks = x[:, : blocks * _CHUNK].view(rows, blocks, _CHUNK).amax(dim=2).topk(k, dim=1).indices  # (R, k)
    cols = (top_blocks.unsqueeze(2) * _CHUNK + torch.arange(_CHUNK, device=x.device)).view(rows, k * _CHUNK)
    if blocks * _CHUNK < v:  # the partial last block always competes
        cols = torch.cat([cols, torch.arange(blocks * _CHUNK, v, device=x.device).expand(rows, -1)], dim=1)
    best, pos = x.gather(1, cols).topk(k, dim=1)  # (R, k)
    return best, cols.gather(1, pos)


def _best_tokens(
    logits: Tensor, model: NMTModel, step: int, min_len: int, forced: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """The ``k`` best constrained log-probs of each row and their tokens, (R, k) each, best first: the top of
    :func:`_constrained_log_probs`. NaN is cleaned only where one reached the top (a row with a NaN ranks it
    first), which spares a pass over the (R, V) log-probs at every step."""
    lprobs = _constrained_log_probs(logits, model, step, min_len, forced, clean_nan=False)  # (R, V)
    best, tok = topk_rows(lprobs, k)
    if bool(best.isnan().any()):
        best, tok = topk_rows(_nan_to_neg_inf_(lprobs), k)
    return best, tok


def _finish(finalized: list[list[Hypothesis]], nbest: int) -> list[list[Hypothesis]]:
    """Best first (stable for ties, like fairseq's sort on CPU), ``nbest`` per sentence."""
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finalized]


# ---------------------------------------------------------------------- beam search
@torch.no_grad()
def beam_search(model: NMTModel, batch: "Batch", cfg: DecodeConfig) -> list[list[Hypothesis]]:
    """Decode ``batch`` with beam search; returns, per input sentence, ``cfg.nbest`` hypotheses best first.

    A sentence can only come back with fewer hypotheses if its model gives every EOS a log-prob of -inf.
    """
    beam, eos, lenpen = cfg.beam, model.eos_id, cfg.lenpen
    n_cand = 2 * beam  # 2 x beam so that `beam` non-EOS candidates always remain
    shared = model.beams_share_memory  # encoder rows and static keys/values kept once per sentence
    bsz = batch.src_mask.shape[0]
    finalized: list[list[Hypothesis]] = [[] for _ in range(bsz)]
    if bsz == 0:
        return finalized
    device = batch.src_mask.device

    with _eval_mode(model):
        enc_out = model.encode(batch)
        state = model.init_state(enc_out).reordered_each_step()

        sent_max_len_list = max_lengths(batch.src_mask, cfg, model.max_positions)
        active: list[int] = list(range(bsz))  # original index of each active sentence
        sent_max_len = torch.tensor(sent_max_len_list, device=device)  # (n,)
        min_max_len = min(sent_max_len_list)  # before this step no row is forced
        first_eos_step = min(cfg.min_len, min_max_len)  # before this step no EOS can be finalised
        k = 1  # hypotheses per active sentence in the current rows: 1 at step 0 (all beams are equal)
        prev = torch.full((bsz, 1), model.bos_id, dtype=torch.long, device=device)  # (R, 1)
        cum = torch.zeros(bsz, device=device)  # (R,) cumulative log-prob of each row
        tokens = torch.empty(bsz, 0, dtype=torch.long, device=device)  # (R, t) tokens so far, no bos
        scores = torch.empty(bsz, 0, device=device)  # (R, t) cumulative log-prob after each token
        cand_offsets = torch.arange(n_cand, device=device)  # (2b,)

        for step in range(max(sent_max_len_list) + 1):
            n = len(active)
            logits = model.decode_step(prev, enc_out, state)  # (R, V)
            forced = sent_max_len.le(step).repeat_interleave(k) if step >= min_max_len else None  # (R,)

            # Candidates: the best 2*beam (hypothesis, token) extensions of each sentence. They lie
            # within the best 2*beam tokens of each hypothesis, so rank those first.
            per_row = min(n_cand, logits.shape[1])
            row_scores, row_tok = _best_tokens(logits, model, step, cfg.min_len, forced, per_row)  # (R, c), (R, c)
            row_scores = row_scores + cum.unsqueeze(1)  # (R, c) cumulative
            flat = row_scores.view(n, k * per_row)  # (n, k*c)
            if k * per_row < n_cand:  # tiny vocabularies: pad with impossible candidates
                flat = F.pad(flat, (0, n_cand - k * per_row), value=NEG_INF)
            cand_scores, cand_idx = flat.topk(n_cand, dim=1)  # (n, 2b)
            cand_idx = cand_idx.clamp_(max=k * per_row - 1)
            cand_tok = row_tok.view(n, k * per_row).gather(1, cand_idx)  # (n, 2b)
            cand_beam = torch.div(cand_idx, per_row, rounding_mode="floor")  # (n, 2b)
            cand_row = cand_beam + torch.arange(n, device=device).unsqueeze(1) * k  # (n, 2b) current row
            eos_mask = cand_tok.eq(eos) & cand_scores.ne(NEG_INF)  # (n, 2b)

            # Finalise EOS candidates ranked within the first `beam` of their sentence (fairseq).
            done: set[int] = set()  # positions in `active`
            if step >= first_eos_step:
                eos_first = eos_mask[:, :beam]  # (n, b)
                if bool(eos_first.any()):
                    pos, col = eos_first.nonzero(as_tuple=True)  # (m,), (m,)
                    touched = _finalize_beam(
                        step, pos, cand_row[pos, col], cand_scores[pos, col], tokens, scores,
                        active, finalized, beam, lenpen,
                    )
                    done.update(p for p in touched if len(finalized[active[p]]) >= beam)
                if step >= min_max_len:
                    done.update(sent_max_len.le(step).nonzero().view(-1).tolist())
            if len(done) == n:
                break

            sentences_changed = k != beam
            keep = None
            if done:  # drop finished sentences from the batch
                kept = [p for p in range(n) if p not in done]
                keep = torch.tensor(kept, device=device)  # (n',)
                active = [active[p] for p in kept]
                sent_max_len = sent_max_len.index_select(0, keep)
                min_max_len = min(sent_max_len_list[s] for s in active)
                first_eos_step = min(cfg.min_len, min_max_len)
                cand_scores, cand_tok, cand_row, eos_mask = (
                    t.index_select(0, keep) for t in (cand_scores, cand_tok, cand_row, eos_mask)
                )
                sentences_changed = True

            # Continue with the first `beam` non-EOS candidates: sort key puts EOS after the rest.
            sort_key = eos_mask.long() * n_cand + cand_offsets  # (n', 2b)
            active_hyp = sort_key.topk(beam, dim=1, largest=False).indices  # (n', b)
            new_row = cand_row.gather(1, active_hyp).view(-1)  # (R',) rows of the current batch
            new_tok = cand_tok.gather(1, active_hyp).view(-1)  # (R',)
            cum = cand_scores.gather(1, active_hyp).view(-1)  # (R',)
            tokens = torch.cat([tokens.index_select(0, new_row), new_tok.unsqueeze(1)], dim=1)  # (R', t+1)
            scores = torch.cat([scores.index_select(0, new_row), cum.unsqueeze(1)], dim=1)  # (R', t+1)

            # The encoder output and the static keys/values take the same rows: one per sentence (only dropped
            # sentences change them), or one per row (expanded at step 0; a sentence's beams share identical
            # rows, so a reorder within its block leaves them).
            memory_rows = keep if shared else (new_row if sentences_changed else None)
            state.reorder(new_row, static=False if memory_rows is None else memory_rows)
            if memory_rows is not None:
                enc_out = enc_out.reorder(memory_rows)
            k = beam
            prev = new_tok.unsqueeze(1)  # (R', 1)

    return _finish(finalized, cfg.nbest)


def _finalize_beam(
    step: int,
    pos: Tensor,
    rows: Tensor,
    final_scores: Tensor,
    tokens: Tensor,
    scores: Tensor,
    active: list[int],
    finalized: list[list[Hypothesis]],
    beam: int,
    lenpen: float,
) -> set[int]:
    """Store the hypotheses ending in EOS at ``step``; returns the active positions they belong to.

    ``pos`` (m,): active-sentence position of each; ``rows`` (m,): the row (in ``tokens``/``scores``,
    (R, step)) it extends; ``final_scores`` (m,): cumulative log-prob including the EOS. A sentence
    keeps at most ``beam`` hypotheses (the first ones finished, as in fairseq).
    """
    cum_hist = torch.cat([scores.index_select(0, rows), final_scores.unsqueeze(1)], dim=1)  # (m, step+1)
    positional = torch.diff(cum_hist, dim=1, prepend=cum_hist.new_zeros(cum_hist.shape[0], 1))  # (m, step+1)
    normalised = final_scores / (step + 1) ** lenpen  # (m,)
    touched: set[int] = set()
    for p, toks, score, pos_scores in zip(
        pos.tolist(), tokens.index_select(0, rows).tolist(), normalised.tolist(), positional.tolist()
    ):
        hyps = finalized[active[p]]
        if len(hyps) < beam:
            hyps.append(Hypothesis(tokens=toks, score=score, positional_scores=pos_scores))
        touched.add(p)
    return touched


# ---------------------------------------------------------------------- greedy search
@torch.no_grad()
def greedy_search(model: NMTModel, batch: "Batch", cfg: DecodeConfig) -> list[list[Hypothesis]]:
    """Batched argmax decoding with beam search's length rules and scoring (equals ``beam=1``).

    ``cfg.beam`` and ``cfg.nbest`` are ignored; each sentence gets one hypothesis (none only if its
    model gives EOS a log-prob of -inf where EOS is forced).
    """
    eos, lenpen = model.eos_id, cfg.lenpen
    bsz = batch.src_mask.shape[0]
    finalized: list[list[Hypothesis]] = [[] for _ in range(bsz)]
    if bsz == 0:
        return finalized
    device = batch.src_mask.device

    with _eval_mode(model):
        enc_out = model.encode(batch)
        state = model.init_state(enc_out)

        max_len_list = max_lengths(batch.src_mask, cfg, model.max_positions)
        active: list[int] = list(range(bsz))  # original index of each active row
        row_max_len = torch.tensor(max_len_list, device=device)  # (R,)
        min_max_len = min(max_len_list)
        first_eos_step = min(cfg.min_len, min_max_len)
        prev = torch.full((bsz, 1), model.bos_id, dtype=torch.long, device=device)  # (R, 1)
        tokens = torch.empty(bsz, 0, dtype=torch.long, device=device)  # (R, t)
        token_lprobs = torch.empty(bsz, 0, device=device)  # (R, t) log-prob of each token

        for step in range(max(max_len_list) + 1):
            logits = model.decode_step(prev, enc_out, state)  # (R, V)
            forced = row_max_len.le(step) if step >= min_max_len else None  # (R,)
            best_lprob, best_tok = (t.squeeze(1) for t in _best_tokens(logits, model, step, cfg.min_len, forced, 1))
            ended = best_tok.eq(eos)  # (R,)
            done = ended | forced if forced is not None else ended  # (R,)
            if step >= first_eos_step and bool(done.any()):  # before first_eos_step nothing can end
                finished = (ended & best_lprob.ne(NEG_INF)).nonzero().view(-1)  # (m,)
                if finished.numel():
                    pos_scores = torch.cat(
                        [token_lprobs.index_select(0, finished), best_lprob[finished].unsqueeze(1)], dim=1
                    )  # (m, step+1)
                    normalised = pos_scores.sum(dim=1) / (step + 1) ** lenpen  # (m,)
                    for r, toks, score, ps in zip(
                        finished.tolist(), tokens.index_select(0, finished).tolist(),
                        normalised.tolist(), pos_scores.tolist(),
                    ):
                        finalized[active[r]].append(Hypothesis(tokens=toks, score=score, positional_scores=ps))
                keep = (~done).nonzero().view(-1)  # (R',)
                if keep.numel() == 0:
                    break
                active = [active[r] for r in keep.tolist()]
                row_max_len = row_max_len.index_select(0, keep)
                min_max_len = min(max_len_list[s] for s in active)
                first_eos_step = min(cfg.min_len, min_max_len)
                best_tok, best_lprob = best_tok.index_select(0, keep), best_lprob.index_select(0, keep)
                tokens, token_lprobs = tokens.index_select(0, keep), token_lprobs.index_select(0, keep)
                state.reorder(keep)
                enc_out = enc_out.reorder(keep)

            tokens = torch.cat([tokens, best_tok.unsqueeze(1)], dim=1)  # (R, t+1)
            token_lprobs = torch.cat([token_lprobs, best_lprob.unsqueeze(1)], dim=1)  # (R, t+1)
            prev = best_tok.unsqueeze(1)  # (R, 1)

    return finalized


# ---------------------------------------------------------------------- corpus-level driver
def translate(
    model: NMTModel,
    batches: Iterable["Batch"],
    cfg: DecodeConfig,
    decode_fn: DecodeFn | None = None,
) -> dict[int, list[Hypothesis]]:
    """Decode every batch; returns hypotheses keyed by ``batch.ids`` so callers restore corpus order.

    ``decode_fn`` defaults to :func:`greedy_search` for ``cfg.beam == 1`` (the same hypotheses as beam
    search with beam 1, with less bookkeeping) and to :func:`beam_search` otherwise.
    The model runs under bf16 autocast when ``cfg.precision`` resolves to bf16 (see :mod:`nmtcore.devices`);
    log-probs and scores stay float32 either way.
    """
    if decode_fn is None:
        decode_fn = greedy_search if cfg.beam == 1 else beam_search
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    results: dict[int, list[Hypothesis]] = {}
    # no_grad, not inference_mode: autocast keeps its bf16 copies of the weights only outside inference mode,
    # so under it every step cast every weight again (the output projection's alone ~4% of a beam-5 decode).
    with _eval_mode(model), torch.no_grad(), autocast(autocast_dtype(cfg.precision, device), device):
        for batch in batches:
            hyps = decode_fn(model, batch, cfg)
            for sent_id, sent_hyps in zip(batch.ids.tolist(), hyps):
                results[int(sent_id)] = sent_hyps
    return results
