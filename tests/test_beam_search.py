"""Beam search against a scripted decoder (fairseq's ``TestIncrementalDecoder`` idea).

The scripted model's next-token distribution is a fixed function of (sentence key, target prefix). The
prefix is read back from ``DecoderState.extras`` (a tensor the search reorders), never from the search's
own bookkeeping, so a wrong reorder changes the distributions and therefore the results. Expected
hypotheses and scores are computed by hand from the scripted probabilities.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch import Tensor

from nmtcore.config import DecodeConfig
from nmtcore.decoding.beam_search import (
    Hypothesis,
    _best_tokens,
    _constrained_log_probs,
    beam_search,
    greedy_search,
    max_lengths,
    topk_rows,
    translate,
)
from nmtcore.models.base import DecoderState, EncoderOut, NMTModel
from nmtcore.testing.zoo import CASES, tiny_model, with_inputs

PAD, BOS, EOS, A, B, C = 0, 1, 2, 3, 4, 5
VOCAB = 6
WORDS = (A, B, C)
log = math.log

Script = Callable[[int, tuple[int, ...]], Tensor]  # (sentence key, prefix without bos) -> (V,) logits


@dataclass
class FakeBatch:
    """The slice of ``nmtcore.data.Batch`` that decoding reads."""

    src: Tensor
    src_mask: Tensor
    ids: Tensor
    extras: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.src.shape[0]


def make_batch(sources: list[list[int]], ids: list[int] | None = None) -> FakeBatch:
    """Right-pad ``sources``; each source's first token is the key that selects its script."""
    width = max(len(s) for s in sources)
    src = torch.full((len(sources), width), PAD, dtype=torch.long)
    for i, s in enumerate(sources):
        src[i, : len(s)] = torch.tensor(s)
    ids = list(range(len(sources))) if ids is None else ids
    return FakeBatch(src=src, src_mask=src.eq(PAD), ids=torch.tensor(ids))


class ScriptedModel(NMTModel):
    """A decoder whose logits are ``script(key, prefix)``; the prefix lives in the reordered state."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.rows_per_step: list[int] = []
        self.memory_rows_per_step: list[int] = []

    def encode(self, batch: FakeBatch) -> EncoderOut:
        return EncoderOut(out=batch.src.float().unsqueeze(-1), mask=batch.src_mask,
                          extras={"key": batch.src[:, 0].clone()})

    def init_state(self, enc_out: EncoderOut) -> DecoderState:
        rows = enc_out.out.shape[0]
        return DecoderState(layers=[], extras={"prefix": torch.empty(rows, 0, dtype=torch.long),
                                               "key": enc_out.extras["key"].clone()})

    def decode_step(self, prev_tokens: Tensor, enc_out: EncoderOut, state: DecoderState) -> Tensor:
        rows = prev_tokens.shape[0]
        assert prev_tokens.shape == (rows, 1) and prev_tokens.dtype == torch.long
        prefix = torch.cat([state.extras["prefix"], prev_tokens], dim=1)  # (R, t+1)
        assert prefix.shape[1] == state.step + 1 and bool((prefix[:, 0] == BOS).all())
        # The encoder rows must follow the state's rows: one per sentence, its beams' rows consecutive
        # (beams_share_memory), or one per row.
        enc_rows = enc_out.extras["key"].shape[0]
        shared = enc_out.extras["key"].repeat_interleave(rows // enc_rows)
        assert enc_rows == (len(set(state.extras["key"].tolist())) if self.beams_share_memory else rows)
        assert torch.equal(state.extras["key"], shared)
        state.extras["prefix"] = prefix
        state.step += 1
        self.rows_per_step.append(rows)
        self.memory_rows_per_step.append(enc_rows)
        keys = state.extras["key"].tolist()
        return torch.stack([self.script(k, tuple(p[1:])) for k, p in zip(keys, prefix.tolist())])


class ExpandedScriptedModel(ScriptedModel):
    """The same decoder, asking for its encoder rows expanded to every beam."""

    beams_share_memory = False


def table_script(table: dict[tuple[int, ...], dict[int, float]]) -> Script:
    """Logits = log of the scripted probabilities (0 -> -inf); unscripted prefixes are uniform."""
    default = {A: 0.25, B: 0.25, C: 0.25, EOS: 0.25}

    def script(key: int, prefix: tuple[int, ...]) -> Tensor:
        logits = torch.full((VOCAB,), float("-inf"))
        for tok, p in table.get(prefix, default).items():
            logits[tok] = log(p)
        return logits

    return script


def random_script(seed: int) -> Script:
    """Deterministic random logits for every (key, prefix)."""
    def script(key: int, prefix: tuple[int, ...]) -> Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, key, prefix)).encode()))
        return torch.randn(VOCAB, generator=g) * 2.0

    return script


def cfg(**kw) -> DecodeConfig:
    base = dict(beam=2, lenpen=1.0, max_len_a=0.0, max_len_b=10, min_len=1, nbest=1)
    base.update(kw)
    return DecodeConfig(**base)


def one(script: Script, src_len: int = 2) -> tuple[ScriptedModel, FakeBatch]:
    return ScriptedModel(script), make_batch([[7] + [A] * (src_len - 2) + [EOS]])


def assert_hyps(got: list[Hypothesis], want: list[tuple[list[int], float]]) -> None:
    assert [h.tokens for h in got] == [t for t, _ in want]
    assert [h.score for h in got] == pytest.approx([s for _, s in want], abs=1e-5)


def assert_same(got: list[list[Hypothesis]], want: list[list[Hypothesis]]) -> None:
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    for hs, ws in zip(got, want):
        for h, w in zip(hs, ws):
            assert h.score == pytest.approx(w.score, abs=1e-5)
            assert h.positional_scores == pytest.approx(w.positional_scores, abs=1e-5)


# ---------------------------------------------------------------------- hand-computed cases
GREEDY_TRAP = table_script({
    (): {A: 0.5, B: 0.4, EOS: 0.1},
    (A,): {EOS: 0.4, A: 0.3, B: 0.3},
    (B,): {EOS: 0.9, A: 0.05, B: 0.05},
})


def test_beam_finds_path_greedy_misses():
    model, batch = one(GREEDY_TRAP)
    # Greedy takes A (0.5) then EOS (0.4): 0.20. Beam 2 keeps B (0.4), whose EOS (0.9) gives 0.36.
    assert_hyps(greedy_search(model, batch, cfg())[0], [([A], log(0.2) / 2)])
    best = beam_search(model, batch, cfg(beam=2, nbest=2))[0]
    assert_hyps(best, [([B], log(0.36) / 2), ([A], log(0.2) / 2)])
    assert best[0].positional_scores == pytest.approx([log(0.4), log(0.9)])
    assert_hyps(beam_search(model, batch, cfg(beam=2, nbest=1))[0], [([B], log(0.36) / 2)])


LENGTHS = table_script({
    (): {A: 0.6, B: 0.4},
    (A,): {EOS: 1.0},
    (B,): {B: 1.0},
    (B, B): {B: 1.0},
    (B, B, B): {EOS: 1.0},
})


@pytest.mark.parametrize("lenpen, want", [
    (0.0, [([A], log(0.6)), ([B, B, B], log(0.4))]),  # raw log-prob: the short one
    (1.0, [([B, B, B], log(0.4) / 4), ([A], log(0.6) / 2)]),
    (2.0, [([B, B, B], log(0.4) / 16), ([A], log(0.6) / 4)]),  # -0.057 > -0.128: the long one
])
def test_length_penalty_ordering(lenpen, want):
    model, batch = one(LENGTHS)
    assert_hyps(beam_search(model, batch, cfg(beam=2, nbest=2, lenpen=lenpen))[0], want)


EARLY_EOS = table_script({
    (): {EOS: 0.9, A: 0.1},
    (A,): {EOS: 0.7, B: 0.3},
    (A, B): {EOS: 1.0},
})


@pytest.mark.parametrize("decode", [beam_search, greedy_search])
@pytest.mark.parametrize("min_len, want", [
    (0, ([], log(0.9) / 1)),
    (1, ([A], log(0.1 * 0.7) / 2)),
    (2, ([A, B], log(0.1 * 0.3) / 3)),
])
def test_min_len_forbids_early_eos(decode, min_len, want):
    model, batch = one(EARLY_EOS)
    assert_hyps(decode(model, batch, cfg(beam=1, min_len=min_len))[0], [want])


NEVER_STOPS = table_script({prefix: {A: 0.9, EOS: 0.1} for prefix in [(), (A,), (A, A), (A, A, A)]})


def test_max_len_forces_eos():
    model, batch = one(NEVER_STOPS)
    c = cfg(beam=2, nbest=2, max_len_b=2)
    # [A] finishes at step 1 among the top-2 candidates; [A, A] is cut at max_len 2 with EOS's own log-prob.
    hyps = beam_search(model, batch, c)[0]
    assert_hyps(hyps, [([A, A], log(0.9 * 0.9 * 0.1) / 3), ([A], log(0.09) / 2)])
    assert hyps[0].positional_scores == pytest.approx([log(0.9), log(0.9), log(0.1)])
    for decode in (beam_search, greedy_search):
        assert_hyps(decode(model, batch, cfg(beam=1, max_len_b=2))[0], [([A, A], log(0.081) / 3)])


@pytest.mark.parametrize("decode", [beam_search, greedy_search])
def test_max_len_follows_source_length(decode):
    # max_len = int(1 * src_len + 1): a source of 2 tokens allows 3 target tokens.
    model, batch = one(NEVER_STOPS, src_len=2)
    c = cfg(beam=1, max_len_a=1.0, max_len_b=1)
    assert max_lengths(batch.src_mask, c) == [3]
    assert_hyps(decode(model, batch, c)[0], [([A, A, A], log(0.9 ** 3 * 0.1) / 4)])


@pytest.mark.parametrize("decode", [beam_search, greedy_search])
def test_max_len_wins_over_min_len(decode):
    model, batch = one(NEVER_STOPS)
    assert_hyps(decode(model, batch, cfg(beam=1, max_len_b=1, min_len=3))[0], [([A], log(0.09) / 2)])


def test_nbest_ordering_and_prefix():
    model = ScriptedModel(random_script(3))
    batch = make_batch([[11, A, EOS], [12, A, A, A, EOS]])
    full = beam_search(model, batch, cfg(beam=4, nbest=4, lenpen=1.0, max_len_a=1.0, max_len_b=2))
    top2 = beam_search(model, batch, cfg(beam=4, nbest=2, lenpen=1.0, max_len_a=1.0, max_len_b=2))
    for hyps, best in zip(full, top2):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert_same([best], [hyps[:2]])
        for h in hyps:  # positional scores add up to the unnormalised score
            assert sum(h.positional_scores) / len(h.positional_scores) == pytest.approx(h.score, abs=1e-5)
            assert len(h.positional_scores) == len(h.tokens) + 1
            assert PAD not in h.tokens and BOS not in h.tokens and EOS not in h.tokens


# ---------------------------------------------------------------------- batching invariants
SOURCES = [[10, A, EOS], [11, A, A, A, A, A, EOS], [12, EOS], [13, A, A, A, EOS], [14, A, A, EOS]]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decode, beam", [(beam_search, 3), (beam_search, 1), (greedy_search, 1)])
@pytest.mark.parametrize("model_class", [ScriptedModel, ExpandedScriptedModel])
def test_batch_equals_sentences_alone(decode, beam, seed, model_class):
    c = cfg(beam=beam, nbest=beam, lenpen=0.8, max_len_a=1.0, max_len_b=1, min_len=1)
    model = model_class(random_script(seed))
    batched = decode(model, make_batch(SOURCES), c)
    rows = model.rows_per_step
    if model_class.beams_share_memory:  # one encoder row per active sentence at every step
        assert model.memory_rows_per_step == [r // (1 if i == 0 else beam) for i, r in enumerate(rows)]
    else:
        assert model.memory_rows_per_step == rows
    alone = [decode(model_class(random_script(seed)), make_batch([s]), c)[0] for s in SOURCES]
    assert_same(batched, alone)
    for hyps, src in zip(batched, SOURCES):
        assert all(len(h.tokens) <= len(src) + 1 for h in hyps)  # max_len = src_len + 1
    # Step 0 runs one row per sentence; finished sentences leave the batch, so rows only shrink.
    assert rows[0] == len(SOURCES)
    assert rows[1:] == sorted(rows[1:], reverse=True)
    assert rows[-1] < len(SOURCES) * beam
    assert len(rows) <= max(len(s) for s in SOURCES) + 2  # at most max_len + 1 steps


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_beam_one(seed):
    c = cfg(beam=1, lenpen=0.7, max_len_a=1.5, max_len_b=2, min_len=2)
    batch = make_batch(SOURCES)
    greedy = greedy_search(ScriptedModel(random_script(seed)), batch, c)
    beam1 = beam_search(ScriptedModel(random_script(seed)), batch, c)
    assert_same(greedy, beam1)


def test_wrong_reorder_is_detected():
    """Sanity check of the harness: a state that loses track of which beam is which changes the results."""

    class NoReorderState(DecoderState):
        def reorder(self, beam_idx: Tensor, static: bool = True) -> None:
            # Rows stay with their sentence (sorted indices keep sentence blocks) but not with their beam.
            super().reorder(beam_idx.sort().values, static)

    class Broken(ScriptedModel):
        def init_state(self, enc_out: EncoderOut) -> DecoderState:
            s = super().init_state(enc_out)
            return NoReorderState(layers=s.layers, extras=s.extras)

    c = cfg(beam=3, nbest=3, max_len_a=1.0, max_len_b=1)
    good = beam_search(ScriptedModel(random_script(0)), make_batch(SOURCES), c)
    broken = beam_search(Broken(random_script(0)), make_batch(SOURCES), c)
    assert [[h.tokens for h in hs] for hs in broken] != [[h.tokens for h in hs] for hs in good]


# ---------------------------------------------------------------------- brute force
def exhaustive(script: Script, key: int, max_len: int, min_len: int, lenpen: float) -> list[tuple[list[int], float]]:
    """Every hypothesis the rules allow, scored as beam search scores it, best first."""
    def lprobs(prefix: tuple[int, ...]) -> list[float]:
        return torch.log_softmax(script(key, prefix).float(), dim=-1).tolist()

    out = []
    for length in range(max_len + 1):
        for seq in itertools.product(WORDS, repeat=length):
            if length < min_len and length < max_len:
                continue
            total = sum(lprobs(seq[:t])[tok] for t, tok in enumerate(seq)) + lprobs(seq)[EOS]
            out.append((list(seq), total / (length + 1) ** lenpen))
    return sorted(out, key=lambda x: -x[1])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lenpen", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("min_len", [0, 2])
def test_large_beam_equals_exhaustive_search(seed, lenpen, min_len):
    # 3 words, max_len 3: at most 40 hypotheses, so a beam of 40 never prunes one.
    script = random_script(100 + seed)
    model = ScriptedModel(script)
    c = cfg(beam=40, nbest=10, lenpen=lenpen, max_len_a=0.0, max_len_b=3, min_len=min_len)
    got = beam_search(model, make_batch([[5, EOS], [6, A, EOS]]), c)
    for hyps, key in zip(got, (5, 6)):
        assert_hyps(hyps, exhaustive(script, key, max_len=3, min_len=min_len, lenpen=lenpen)[:10])


# ---------------------------------------------------------------------- corpus driver
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_translate_keys_by_ids(precision):
    c = cfg(beam=3, nbest=2, max_len_a=1.0, max_len_b=1, precision=precision)
    model = ScriptedModel(random_script(7))
    model.train()
    batches = [make_batch(SOURCES[:2], ids=[4, 0]), make_batch(SOURCES[2:], ids=[3, 1, 2])]
    out = translate(model, batches, c)
    assert sorted(out) == [0, 1, 2, 3, 4]
    assert model.training  # mode restored
    for sent_id, src in zip([4, 0, 3, 1, 2], SOURCES):
        assert_same([out[sent_id]], beam_search(ScriptedModel(random_script(7)), make_batch([src]), c))
    greedy = translate(model, batches, c, decode_fn=greedy_search)
    assert all(len(h) == 1 for h in greedy.values())


# ---------------------------------------------------------------------- real models
@pytest.mark.parametrize("case", sorted(CASES))
def test_registered_models_decode_a_padded_batch_like_sentences_alone(case, small_batch):
    """The search drives each real model's caches: step-0 expansion, beam reorders, dropped sentences."""
    model = tiny_model(case)  # left in train mode: the search must switch dropout off itself
    # max_len = src_len + 1 differs per sentence, so sentences leave the batch at different steps.
    c = DecodeConfig(beam=3, nbest=3, max_len_a=1.0, max_len_b=1, min_len=0, precision="fp32")
    small_batch = with_inputs(model, small_batch)
    batched = beam_search(model, small_batch, c)
    assert model.training
    for i, hyps in enumerate(batched):
        n = int((~small_batch.src_mask[i]).sum())
        src = small_batch.src[i : i + 1, :n]
        alone = beam_search(model, with_inputs(model, FakeBatch(src=src, src_mask=src.eq(model.pad_id),
                                                                  ids=torch.tensor([i]))), c)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone[0]]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone[0]], abs=1e-4)


def test_beam_search_keeps_its_caches_narrow_and_greedy_search_wide(small_batch, monkeypatch):
    """Beam search reorders every row of every cache at each step, so its bf16 steps keep the self-attention
    prefix in bf16; greedy search, which reorders only when sentences finish, widens it to fp32
    (:func:`nmtcore.nn.layers.wide_decoding_cache`, here for any head width)."""
    from nmtcore.nn import SelfAttention, layers

    monkeypatch.setattr(layers, "WIDE_CACHE_MIN_HEAD_DIM", 1)
    model = tiny_model("transformer")
    small_batch = with_inputs(model, small_batch)
    caches = []
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.register_forward_hook(lambda m, args, kwargs, out: caches.append(kwargs.get("cache")),
                                         with_kwargs=True)
    for beam, dtype in ((3, torch.bfloat16), (1, torch.float32)):
        caches.clear()
        translate(model, [small_batch], DecodeConfig(beam=beam, max_len_a=1.0, max_len_b=2, min_len=0,
                                                     precision="bf16"))  # greedy search for beam 1
        grown = [x for x in caches if x is not None and x.self_k is not None]
        assert grown and all(x.self_k.dtype == x.self_v.dtype == dtype for x in grown), beam
        assert all(x.reordered_each_step == (beam > 1) for x in grown)


# ---------------------------------------------------------------------- the step's candidates
@pytest.mark.parametrize("vocab,k", [(1000, 10), (8000 + 37, 10), (5000, 4), (300, 10)])
def test_topk_rows_equals_topk(vocab, k):
    """Blocks' maxima first, then topk within the best blocks (and the partial last one): the same values and
    tokens as one topk over each whole row, including rows whose best entries share one block or lie in the
    partial block, and rows mostly -inf (barred tokens)."""
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(24, vocab, generator=g)
    x[1, 64:64 + k] = 50.0 + torch.arange(k, dtype=torch.float32)  # all in one block
    x[2, -3:] = 60.0  # the partial last block (when there is one) holds three of the best
    x[2, -3:] += torch.arange(3, dtype=torch.float32)
    x[3, : vocab - 2 * k] = float("-inf")  # almost every token barred
    x[4, ::2] = float("-inf")
    want_v, want_i = x.topk(k, dim=1)
    got_v, got_i = topk_rows(x, k)
    assert torch.equal(got_v, want_v)
    assert torch.equal(got_i, want_i)


def test_topk_rows_ranks_nan_first_like_topk():
    x = torch.randn(3, 4096, generator=torch.Generator().manual_seed(3))
    x[1, 1234] = float("nan")
    got_v, got_i = topk_rows(x, 6)
    assert bool(got_v[1, 0].isnan()) and int(got_i[1, 0]) == 1234
    assert torch.equal(got_v[[0, 2]], x[[0, 2]].topk(6, dim=1).values)


@pytest.mark.parametrize("step,forced", [(0, None), (3, None), (3, [True, False, False, True, False, False])])
def test_best_tokens_are_the_top_of_the_constrained_log_probs(step, forced):
    """Candidates without cleaning NaN over the whole vocabulary: NaN/inf rows still rank as fairseq's rule (NaN ->
    -inf) has them, pad/bos/min_len/forced EOS as in the full constrained log-probs."""
    model = ScriptedModel(random_script(0))
    g = torch.Generator().manual_seed(step)
    logits = torch.randn(6, 3000, generator=g) * 3
    logits[1, 17] = float("nan")  # a whole row of NaN log-probs
    logits[2, 5] = float("inf")
    forced_t = None if forced is None else torch.tensor(forced)
    want = _constrained_log_probs(logits.clone(), model, step, 2, forced_t).topk(10, dim=1)
    got_v, got_i = _best_tokens(logits.clone(), model, step, 2, forced_t, 10)
    finite = want.values.isfinite()
    assert torch.equal(got_v.isfinite(), finite)
    assert torch.equal(got_v[finite], want.values[finite])
    assert torch.equal(got_i[finite], want.indices[finite])
    assert not bool(got_v.isnan().any())
    if forced is not None:  # a forced row offers EOS (its real log-prob) and nothing else
        assert int(got_i[0, 0]) == EOS and bool(got_v[0, 0].isfinite()) and not bool(got_v[0, 1:].isfinite().any())


@pytest.mark.parametrize("case", sorted(CASES))
def test_registered_models_decode_alike_with_their_memory_shared_by_beams_or_copied(case, small_batch):
    """Every registered model decodes with one encoder/BERT row per sentence shared by its beams
    (``beams_share_memory``) exactly as with those rows copied to every beam."""
    model = tiny_model(case)
    assert model.beams_share_memory
    c = DecodeConfig(beam=4, nbest=4, max_len_a=1.0, max_len_b=2, min_len=0, precision="fp32")
    small_batch = with_inputs(model, small_batch)
    shared = beam_search(model, small_batch, c)
    model.beams_share_memory = False  # this instance only
    copied = beam_search(model, small_batch, c)
    assert_same(shared, copied)


@pytest.mark.parametrize("model_name", ["transformer", "bert_fused", "mask_fusion"])
def test_a_line_longer_than_the_model_positions_is_truncated_with_a_warning_and_the_rest_translated(
        tmp_path, caplog, model_name):
    """A source past ``model.max_positions`` (and a decoding budget 1.2 x source + 10 past them) crashed the
    whole decode; now that line is cut to fit, named in a warning, and every line gets a translation."""
    import logging

    from nmtcore.decoding.translator import Translator
    from nmtcore.engine import build_trainer
    from nmtcore.testing.synthetic import tiny_experiment
    from nmtcore.testing.tiny_bert import tiny_bert_dir

    bert = {} if model_name == "transformer" else {"model.bert.name": tiny_bert_dir()}
    cfg = tiny_experiment(tmp_path, **{"model.name": model_name, "model.max_positions": 24, **bert})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    words = trainer.data.splits["valid"].raw_src[0].split()
    lines = [" ".join(words[:3]), " ".join((words * 20)[:60]), " ".join(words[:4])]
    translator = Translator(trainer.model, trainer.data.vocab, cfg, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="nmtcore.decoding"):
        hyps = translator.translate(lines)
    assert len(hyps) == 3
    warned = [r.getMessage() for r in caplog.records if "positions hold" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("input line 2: ") and "the model's 24 positions" in warned[0]
    src_mask = torch.zeros(1, 60, dtype=torch.bool)  # a 60-token source: budget 1.2 x 60 + 10, capped at 24 - 1
    assert max_lengths(src_mask, DecodeConfig(max_len_a=1.2, max_len_b=10), 24) == [23]
    assert max_lengths(src_mask, DecodeConfig(max_len_a=1.2, max_len_b=10)) == [82]
