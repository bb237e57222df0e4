"""Activation checkpointing over a fine-tuned BERT's layers: the same loss and gradients as without it,
far fewer activations kept for the backward pass, no effect on a frozen BERT, safe to deep-copy."""

from __future__ import annotations

import copy

import pytest
import torch

from nmtcore.bert import BertLayer
from nmtcore.bert.layer import encoder_layers
from nmtcore.config import BertConfig
from nmtcore.nn.checkpointing import is_checkpointed
from nmtcore.testing.package_index import save_tiny_mpnet
from nmtcore.testing.tiny_bert import save_tiny_bert


@pytest.fixture(scope="module", params=["bert", "mpnet"])
def bert_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "bert":
        return save_tiny_bert(path, layers=3, hidden=64)
    return save_tiny_mpnet(path, layers=3, hidden=64)


def _inputs(n: int = 6, t: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 25, (n, t), generator=g)
    mask = torch.zeros(n, t, dtype=torch.bool)
    mask[0, t // 2:] = True  # one padded row
    return ids, mask, torch.zeros(n, t, dtype=torch.long)


def _layer(path, checkpointing: bool, freeze: bool = False) -> BertLayer:
    layer = BertLayer(BertConfig(name=str(path), freeze=freeze, use_cache=False,
                                 activation_checkpointing=checkpointing))
    return layer.train()


def _loss_and_grads(layer: BertLayer, seed: int = 7):
    ids, mask, seg = _inputs()
    torch.manual_seed(seed)  # the BERT's own dropout: the same masks in both runs
    states = layer.run(ids, mask, seg)
    loss = sum((s.float() ** 2).mean() for s in states)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _saved_bytes(layer: BertLayer) -> int:
    """Bytes autograd keeps for the backward pass of one forward (outside recomputed regions)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    ids, mask, seg = _inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.run(ids, mask, seg)
    return total


def test_checkpointed_bert_gives_the_eager_loss_and_gradients(bert_dir):
    eager, ckpt = _layer(bert_dir, False), _layer(bert_dir, True)
    assert not any(is_checkpointed(m) for m in encoder_layers(eager.bert))
    assert all(is_checkpointed(m) for m in encoder_layers(ckpt.bert)) and ckpt.checkpointed_layers == 3
    assert eager.bert.config.hidden_dropout_prob > 0  # dropout is live: the recompute must replay its masks
    loss_e, grads_e = _loss_and_grads(eager)
    loss_c, grads_c = _loss_and_grads(ckpt)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=1e-6)
    assert grads_e.keys() == grads_c.keys() and len(grads_e) > 10
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-7, msg=name)
    # The weights (and so checkpoints and feature-cache fingerprints) are untouched by the wrapping.
    assert eager.state_dict().keys() == ckpt.state_dict().keys()
    assert eager.fingerprint() == ckpt.fingerprint()


def test_checkpointing_keeps_far_fewer_activations(bert_dir):
    eager, ckpt = _layer(bert_dir, False), _layer(bert_dir, True)
    kept_eager, kept_ckpt = _saved_bytes(eager), _saved_bytes(ckpt)
    assert kept_eager > 0
    assert kept_ckpt < 0.4 * kept_eager, (kept_ckpt, kept_eager)


def test_frozen_or_eval_bert_runs_plainly(bert_dir):
    frozen = _layer(bert_dir, True, freeze=True)
    assert all(is_checkpointed(m) for m in encoder_layers(frozen.bert))  # armed for a later unfreeze...
    ids, mask, seg = _inputs()
    with torch.no_grad():
        plain = _layer(bert_dir, False, freeze=True).run(ids, mask, seg)
        wrapped = frozen.run(ids, mask, seg)
    for a, b in zip(plain, wrapped):  # ...and a frozen (eval-mode) BERT computes exactly as before
        assert torch.equal(a, b)
    trainable = _layer(bert_dir, True).eval()
    assert _saved_bytes(trainable) == _saved_bytes(_layer(bert_dir, False).eval())  # eval: nothing recomputed


def test_deep_copy_checkpoints_its_own_layers(bert_dir):
    layer = _layer(bert_dir, True)
    clone = copy.deepcopy(layer)
    for orig, mine in zip(encoder_layers(layer.bert), encoder_layers(clone.bert)):
        assert mine.__dict__["forward"].module is mine and mine is not orig
    _, grads = _loss_and_grads(clone)
    assert all(p.grad is None for p in layer.parameters())  # the copy's backward never reached the original
    assert grads
