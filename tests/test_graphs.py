"""``train.cuda_graphs`` on the CPU: what a graph replays must be the eager step. The padding to bucket shapes
leaves the loss and the gradient unchanged; the trainer's graphed path (host padding, gradients kept between
updates) trains as the eager one; runs a graph cannot serve train eagerly and say why. The capture itself needs a
GPU: ``bench/gpu.py --sections graphs`` checks it there against eager steps on the same batches."""

from __future__ import annotations

import functools
import itertools
import logging

import pytest
import torch

from nmtcore.config import preset
from nmtcore.engine import build_trainer
from nmtcore.engine.graphs import LEN_MULTIPLE, ROWS_MULTIPLE, bucket_shape, pad_batch, pad_to_bucket, why_not
from nmtcore.engine.losses import label_smoothed_nll
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.zoo import PAD, make_batch, tiny_model, with_inputs

SRC = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]]
TGT = [[17, 18, 19], [20, 21, 22, 23, 24], [25]]


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    lo = label_smoothed_nll(model(batch).logits, batch.tgt_out, 0.1, PAD, batch.n_tgt_tokens)
    lo.loss.backward()
    return lo.loss.detach(), lo.nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}


@pytest.mark.parametrize("case", ["transformer", "bert_fused"])
def test_padding_to_a_bucket_changes_neither_the_loss_nor_the_gradient(case):
    model = tiny_model(case).eval()  # no dropout, drop-net's average: both passes compute the same function
    batch = with_inputs(model, make_batch(SRC, TGT))
    padded = pad_batch(batch, 16, 16, 8, PAD)
    assert padded.src.shape == (16, 16) and padded.tgt_in.shape == (16, 8) and padded.n_tgt_tokens == batch.n_tgt_tokens
    assert all(v.size(0) == 16 for v in padded.extras.values())
    if "bert_mask" in batch.extras:  # the BERT stream is bucketed too, its new positions masked
        tb = batch.extras["bert_mask"].size(1)
        assert padded.extras["bert_mask"].size(1) == -(-tb // LEN_MULTIPLE) * LEN_MULTIPLE > tb - 1
        assert padded.extras["bert_mask"][:3, tb:].all() and padded.extras["bert_align"].size(1) == 16
    assert (padded.tgt_out[3:] == PAD).all() and not padded.tgt_mask[3:, 0].any()  # no all-padding attention row
    loss, nll, grads = loss_and_grads(model, batch)
    p_loss, p_nll, p_grads = loss_and_grads(model, padded)
    torch.testing.assert_close(p_loss, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_nll, nll, rtol=1e-5, atol=1e-5)
    assert p_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(p_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert loss > 0 and any(g.abs().sum() > 0 for g in grads.values())


def test_bucket_shapes_round_up_and_padding_never_shrinks():
    batch = make_batch(SRC, TGT)  # 3 rows, source 7 (6 + eos), target 6
    assert bucket_shape(batch) == (ROWS_MULTIPLE, LEN_MULTIPLE, LEN_MULTIPLE)
    assert bucket_shape(pad_to_bucket(batch, PAD)) == bucket_shape(batch)
    assert pad_to_bucket(batch, PAD).src.shape == (ROWS_MULTIPLE, LEN_MULTIPLE)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_batch(batch, 2, 8, 8, PAD)


def test_why_a_run_is_not_graphed():
    cfg = preset("multi30k_small")
    cuda = torch.device("cuda")
    base = tiny_model("transformer")
    assert why_not(cfg, base, cuda, 1) is None
    assert "cpu" in why_not(cfg, base, torch.device("cpu"), 1)
    assert "DDP" in why_not(cfg, base, cuda, 2)
    assert "compile" in why_not(cfg.with_overrides({"train.compile": True}), base, cuda, 1)
    assert "KD" in why_not(cfg.with_overrides({"train.kd_alpha": 0.9}), base, cuda, 1)
    # A family subclassing the baseline does not inherit its declaration; BERT-fused declares its own (its
    # drop-net draws are planned on the host), BERT-JAM does not.
    assert why_not(cfg, tiny_model("bert_fused"), cuda, 1) is None
    assert "BertJam" in why_not(cfg, tiny_model("bert_jam"), cuda, 1)


class EagerGraphs:
    """Stands in for StepGraphs on the CPU: replays nothing, runs the step the graph would hold (drop-net's
    weights planned on the host first, read by the forward from a tensor, as a replay reads them)."""

    def __init__(self, forward_backward, draws=None):
        self.forward_backward, self.runs, self.draws = forward_backward, [], draws

    def run(self, batch):
        self.runs.append(tuple(batch.src.shape))
        if self.draws is not None:
            self.draws.plan()
        return self.forward_backward(batch)


def test_the_graphed_path_of_the_trainer_trains_as_the_eager_one(tmp_path, caplog):
    """The trainer's path with graphs (batches padded to buckets in the prefetch thread, the forward and backward
    through ``_forward_backward``, gradients zeroed in place) gives the eager path's losses and weights over
    three updates, gradient accumulation included. On the CPU ``train.cuda_graphs`` logs why it trains eagerly."""
    runs = {}
    for graphed in (False, True):
        cfg = tiny_experiment(tmp_path / str(graphed), **{"train.cuda_graphs": graphed, "train.update_freq": 2})
        with caplog.at_level(logging.INFO, logger="nmtcore.engine"):
            trainer = build_trainer(cfg, device=torch.device("cpu"))
        assert trainer.graphs is None
        if graphed:
            assert "train.cuda_graphs: trains eagerly: the device is cpu" in caplog.text
            trainer.graphs = EagerGraphs(functools.partial(trainer._forward_backward, trainer.model, cache=False))
        batches = list(itertools.islice(trainer.train_batches(1), 6))
        if graphed:
            assert all(b.src.size(0) % ROWS_MULTIPLE == 0 and b.src.size(1) % LEN_MULTIPLE == 0
                       and b.tgt_in.size(1) % LEN_MULTIPLE == 0 for b in batches)
        losses = [trainer.train_step(batches[i: i + 2])["loss_sum"] for i in range(0, 6, 2)]
        if graphed:
            assert len(trainer.graphs.runs) == 6
            assert all(p.grad is not None and not p.grad.any() for p in trainer.model.parameters() if p.requires_grad)
        runs[graphed] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (eager, w_eager), (graphed, w_graphed) = runs[False], runs[True]
    assert graphed == pytest.approx(eager, rel=1e-5)
    for name, value in w_eager.items():
        torch.testing.assert_close(w_graphed[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert not torch.equal(build_trainer(cfg, device=torch.device("cpu")).model.state_dict()["tgt_embed.weight"],
                           w_eager["tgt_embed.weight"])


@pytest.mark.parametrize("zero_grads", [False, True], ids=["skipped-branch-no-grad", "zero-grads"])
def test_graphed_drop_net_trains_as_eager_drop_net(tmp_path, zero_grads):
    """BERT-fused with drop-net (p_net 1: every layer trains through one branch) on the graphed path: the weights
    planned on the host before each forward are the eager draws, both branches run and are weighed, and the branch
    no batch of an update used gets no Adam step (as eagerly, where it has no gradient). Three updates of two
    batches give the eager run's losses and weights; so does ``model.drop_net_zero_grads`` (zeros either way)."""
    from nmtcore.testing.zoo import TINY_BERT

    runs = {}
    for graphed in (False, True):
        cfg = tiny_experiment(tmp_path / str(graphed), **{
            "model.name": "bert_fused", "model.bert.name": TINY_BERT["name"], "model.p_net": 1.0,
            "model.drop_net_zero_grads": zero_grads, "train.cuda_graphs": graphed, "train.update_freq": 2})
        trainer = build_trainer(cfg, device=torch.device("cpu"))
        if graphed:
            draws = trainer.model.graph_draws(torch.device("cpu"))
            trainer.graphs = EagerGraphs(functools.partial(trainer._forward_backward, trainer.model, cache=False),
                                         draws)
        batches = list(itertools.islice(trainer.train_batches(1), 6))
        losses = [trainer.train_step(batches[i: i + 2])["loss_sum"] for i in range(0, 6, 2)]
        runs[graphed] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (eager, w_eager), (graphed, w_graphed) = runs[False], runs[True]
    assert graphed == pytest.approx(eager, rel=1e-5)
    for name, value in w_eager.items():
        torch.testing.assert_close(w_graphed[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_planned_draws_are_the_eager_draws_and_name_the_unused_branches():
    model = tiny_model("bert_fused").train()
    twin = tiny_model("bert_fused").train()
    twin.load_state_dict(model.state_dict())
    eager = [[model.enc_drop_net.weights() for _ in model.encoder_layers] for _ in range(5)]
    draws = twin.graph_draws(torch.device("cpu"))
    for expected in eager:
        draws.plan()
        got = [twin.enc_drop_net.weights() for _ in twin.encoder_layers]
        assert [(float(a), float(b)) for a, b in got] == expected
        unused = {id(p) for p in draws.unused()}
        for layer, (w_self, w_bert) in zip(twin.encoder_layers, expected):
            assert all((id(p) in unused) == (w_self == 0.0) for p in layer.self_attn.parameters())
            assert all((id(p) in unused) == (w_bert == 0.0) for p in layer.bert_attn.parameters())
    # The host state is what a checkpoint saves: a model loaded from it draws on from there.
    third = tiny_model("bert_fused").train()
    third.load_state_dict(twin.state_dict())
    assert third.enc_drop_net.eq3() == twin.enc_drop_net.eq3()


def test_the_gpu_bench_runs_its_graph_options_on_the_cpu(tmp_path):
    """``bench/gpu.py`` parses its graph options and runs on the CPU (its checks need CUDA: skipped, said so)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu.jsonl"
    r = subprocess.run([sys.executable, str(root / "bench" / "gpu.py"), "--device", "cpu", "--smoke-test",
                        "--sections", "env,graphs", "--graphs-check-only", "--trial-graphs", "--out", str(out),
                        "--graphs-model", "bert_fused", "--graphs-precisions", "bf16", "--graphs-scales", "1",
                        "--scratch", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["section"] for row in rows] == ["env", "graphs"]
    assert rows[1] == {"section": "graphs", "skipped": "CUDA only"}
