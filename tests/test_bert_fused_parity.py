"""BERT-fused: what decoding computes is what the validation loss scores (seed 002, Eq. 1-2 at inference).

Three invariants between teacher-forced scoring and decoding, each over a BERT stream with padding and
several sentences: the eval-mode forward is Eq. 1 / Eq. 2's average in every encoder and decoder layer
(rebuilt by hand from the layers' parts); every hypothesis beam or greedy search returns carries the
teacher-forced log-probs of its own tokens (so the per-beam BERT keys/values and ``bert_mask`` follow their
sentence through expansion, reorders and finished sentences leaving); and the cached BERT features a
batch gathers for sentence ``i`` are BERT run live on sentence ``i``'s raw line alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from nmtcore.config import DecodeConfig, ExperimentConfig
from nmtcore.decoding.beam_search import beam_search, greedy_search
from nmtcore.models import build_model
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB, make_batch, tiny_model, with_inputs

FUSED_CASES = ["bert_fused", "bert_fused_pnet0"]
# Five sentences of different lengths: the BERT stream (and the source) are padded, and with max_len = src_len + 2
# the sentences leave the search at different steps.
SOURCES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25]]
TARGETS = [[4, 5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18], [19, 20, 21, 22, 23]]


def fused_batch(model):
    batch = with_inputs(model, make_batch(SOURCES, TARGETS))
    assert bool(batch.extras["bert_mask"].any())  # the BERT stream is padded
    return batch


def by_hand_logits(model, batch) -> Tensor:
    """Eq. 1 (encoder) and Eq. 2 (decoder) at inference, every layer: ½·(branch 1 + branch 2), from the parts."""
    bert_out = model.bert(batch)
    bert, bert_mask = bert_out.last, bert_out.mask  # (B, Tb, H), (B, Tb)
    x = model.embed(batch.src, model.src_embed)  # (B, S, C)
    for layer in model.encoder_layers:
        h = layer.self_res.before(x)
        y = 0.5 * layer.self_attn(h, key_padding_mask=batch.src_mask) + 0.5 * layer.bert_attn(h, bert, bert_mask)
        x = layer.self_res.after(x, y)
        x = layer.ffn_res.after(x, layer.ffn(layer.ffn_res.before(x)))
    enc = model.encoder_norm(x)
    s = model.embed(batch.tgt_in, model.tgt_embed)  # (B, T, C)
    for layer in model.decoder_layers:
        s = layer.self_res.after(s, layer.self_attn(layer.self_res.before(s), causal=True))
        h = layer.cross_res.before(s)
        y = 0.5 * layer.bert_attn(h, bert, bert_mask) + 0.5 * layer.cross_attn(h, enc, batch.src_mask)
        s = layer.cross_res.after(s, y)
        s = layer.ffn_res.after(s, layer.ffn(layer.ffn_res.before(s)))
    return model.output_logits(model.decoder_norm(s))  # (B, T, V)


def prenorm_fused():
    torch.manual_seed(0)
    cfg = ExperimentConfig.from_dict({"model": {"name": "bert_fused", **TINY, "bert": TINY_BERT, "pre_norm": True}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


@pytest.mark.parametrize("case", FUSED_CASES + ["pre_norm"])
def test_eval_forward_is_the_branch_average_in_every_layer(case):
    model = (prenorm_fused() if case == "pre_norm" else tiny_model(case)).eval()
    batch = fused_batch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(batch).logits, by_hand_logits(model, batch), atol=1e-5, rtol=1e-5)


def teacher_forced_scores(model, src: list[int], tokens: list[int]) -> list[float]:
    """log p(token_t | prefix, src) of ``tokens`` + [eos], teacher-forced (the validation loss' forward)."""
    batch = with_inputs(model, make_batch([src], [tokens]))
    with torch.no_grad():
        lprobs = torch.log_softmax(model(batch).logits.float(), dim=-1)[0]  # (T, V)
    return lprobs.gather(1, batch.tgt_out[0].unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("beam", [1, 4])
def test_every_hypothesis_carries_its_teacher_forced_log_probs(case, beam):
    """The search's per-token scores of each hypothesis equal the teacher-forced log-probs of that hypothesis for
    that sentence: a BERT row, a ``bert_mask`` row or a cached BERT key/value of another sentence or beam (expansion
    at step 0, reorders, sentences leaving) would change them."""
    model = tiny_model(case).eval()
    batch = fused_batch(model)
    c = DecodeConfig(beam=beam, nbest=beam, max_len_a=1.0, max_len_b=2, min_len=1, precision="fp32")
    results = (greedy_search if beam == 1 else beam_search)(model, batch, c)
    checked = 0
    for src, hyps in zip(SOURCES, results):
        assert len(hyps) == beam
        for h in hyps:
            want = teacher_forced_scores(model, src, h.tokens)
            assert len(h.positional_scores) == len(want) == len(h.tokens) + 1
            assert h.positional_scores == pytest.approx(want, abs=1e-4), (src, h.tokens)
            checked += 1
    assert checked == beam * len(SOURCES)


@pytest.mark.parametrize("case", FUSED_CASES)
def test_the_hypotheses_depend_on_their_own_sentences_bert_stream(case):
    """Decoding reads BERT: giving sentence 0 sentence 2's BERT stream changes its scores, not the others'."""
    model = tiny_model(case).eval()
    batch = fused_batch(model)
    c = DecodeConfig(beam=3, nbest=3, max_len_a=1.0, max_len_b=2, min_len=1, precision="fp32")
    base = beam_search(model, batch, c)
    other = fused_batch(model)
    for key in ("bert_ids", "bert_mask", "bert_segments"):
        other.extras[key] = other.extras[key].clone()
        other.extras[key][0] = batch.extras[key][2]
    swapped = beam_search(model, other, c)
    assert [h.score for h in swapped[0]] != pytest.approx([h.score for h in base[0]], abs=1e-6)
    for i in range(1, len(SOURCES)):
        assert [h.tokens for h in swapped[i]] == [h.tokens for h in base[i]]
        assert [h.score for h in swapped[i]] == pytest.approx([h.score for h in base[i]], abs=1e-5)


# ---------------------------------------------------------------------- the BERT stream of every split
def test_cached_features_of_every_split_are_bert_on_that_sentence(tmp_path):
    """For every split (train, valid, test) the cached features a decoding batch gathers for sentence ``i``
    (``inference_batches``: length-sorted, out of order) are the BERT run live on split ``i``'s raw source line
    alone, tokenized independently by the Hugging Face tokenizer with its own special tokens."""
    from nmtcore.bert import BertLayer, prepare_bert_inputs
    from nmtcore.config import BertConfig
    from nmtcore.data import inference_batches, prepare_data
    from nmtcore.testing.synthetic import tiny_experiment
    from nmtcore.testing.tiny_bert import tiny_bert_dir

    cfg = tiny_experiment(tmp_path)
    data = prepare_data(cfg.data)
    layer = BertLayer(BertConfig(name=tiny_bert_dir()), layers=(-1,))
    prepare_bert_inputs(layer, data)
    tok = layer.resolved.load_tokenizer()
    rng = np.random.default_rng(0)
    for name, split in data.splits.items():
        assert split.bert.features is not None, name
        sub = split.select(np.sort(rng.choice(len(split), 40, replace=False)))  # the features follow select
        seen = 0
        for batch in inference_batches(sub, data.vocab, 16):
            feats = batch.extras["bert_features"][:, :, -1].float()  # (B, Tb, H)
            for b, i in enumerate(batch.ids.tolist()):
                ids = torch.tensor(tok(sub.raw_src[i], add_special_tokens=True)["input_ids"])
                n = int((~batch.extras["bert_mask"][b]).sum())
                assert n == len(ids) and torch.equal(batch.extras["bert_ids"][b, :n], ids), (name, i)
                with torch.no_grad():
                    live = layer.bert(input_ids=ids[None], attention_mask=torch.ones(1, n, dtype=torch.long))
                torch.testing.assert_close(feats[b, :n], live.last_hidden_state[0], atol=3e-3, rtol=3e-3)
                seen += 1
        assert seen == len(sub), name
