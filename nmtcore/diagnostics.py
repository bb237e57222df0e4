"""How much a trained model used BERT, measured on the validation set after training: what lets a report say
*why* an arm won or lost.

Three kinds of figure, each from a hook every model declares (:class:`~nmtcore.models.NMTModel`):

- ``valid_bleu/<switch>``: greedy validation BLEU under each of the model's inference switches
  (:meth:`~nmtcore.models.NMTModel.inference_switches`; BERT-fused: ``mix`` = Eq. 1, ``nmt_only``, ``bert_only``,
  ``enc_bert_off``, ``dec_bert_off``);
- ``bert_usage/<name>``: figures read off the weights (:meth:`~nmtcore.models.NMTModel.bert_usage`; BERT-JAM's GLU
  weight per BERT layer);
- ``probe/<name>``: figures gathered over one teacher-forced pass of the validation set
  (:meth:`~nmtcore.models.NMTModel.usage_probe`; document context: its gates' BERT share; mask fusion: the
  masked fraction; BERT-JAM: its joint attentions' share on BERT; PLM-sponsored: the coordinator's attention on
  each part, the source BERT's distance from the pretrained one, the MLM and target-LM accuracies).

And for every model, the control too, how its scores and its translations relate, under each switch (or, for a
model without switches, as ``tested``): ``valid_bleu/<switch>``, ``valid_len_ratio/<switch>`` (the greedy
output's length over the references', sacreBLEU's tokens: below 1 costs the brevity penalty),
``valid_token_acc/<switch>`` (teacher-forced: the share of target tokens that are the model's top choice),
``valid_entropy/<switch>`` and ``valid_nll/<switch>`` (bits per target token, no label smoothing). Two arms with
equal validation NLL can decode to different BLEU: these say whether the gap is in the top choices (accuracy),
in how spread the distribution is (entropy), or in the length of what greedy search writes.

The tracking callback logs them with the run (metrics ``diag/...`` and ``diagnostics.json``), so a sweep's report
reads them back per arm.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch

from nmtcore import bleu
from nmtcore.config import DecodeConfig
from nmtcore.devices import autocast
from nmtcore.models import NMTModel

if TYPE_CHECKING:
    from nmtcore.data import EncodedSplit
    from nmtcore.engine import Trainer

PREFIX = "diag/"  # the MLflow metric prefix of every figure here
TESTED = "tested"  # the one "switch" of a model without inference switches: as it is tested


@torch.no_grad()
def measure(trainer: "Trainer") -> dict[str, float]:
    """The model's diagnostics on the trainer's validation split, with the weights it holds now (after
    :meth:`~nmtcore.engine.trainer.Trainer.finalize_model`: the tested ones)."""
    model = trainer.model
    switches = model.inference_switches() or {TESTED: contextlib.nullcontext}
    usage = model.bert_usage()
    out: dict[str, float] = {}
    split = trainer.data.splits[trainer.cfg.data.valid_split]
    was_training = model.training
    model.eval()
    try:
        greedy = DecodeConfig(**{**trainer.cfg.decode.__dict__, "beam": 1, "nbest": 1})
        for name, switch in switches.items():
            with switch():
                score = bleu.corpus_bleu(trainer.translate(split, greedy), split.raw_tgt)
                out[f"valid_bleu/{name}"] = score.score
                if not math.isnan(score.len_ratio):
                    out[f"valid_len_ratio/{name}"] = score.len_ratio
                out.update({f"{k}/{name}": v for k, v in scoring(trainer, split).items()})
        out.update({f"bert_usage/{k}": float(v) for k, v in usage.items()})
        if _has_probe(model):
            with model.usage_probe() as probe:
                for batch in trainer.eval_batches(split):
                    with autocast(trainer.amp_dtype, trainer.device):
                        model(batch)
            out.update({f"probe/{k}": float(v) for k, v in probe.items()})
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def scoring(trainer: "Trainer", split: "EncodedSplit") -> dict[str, float]:
    """One teacher-forced pass of ``split`` in the model's current mode: ``valid_token_acc`` (top choice = the
    reference token), ``valid_entropy`` and ``valid_nll`` (bits per target token, no label smoothing)."""
    model, pad = trainer.model, trainer.data.vocab.pad_id
    n = correct = 0
    entropy = nll = 0.0
    for batch in trainer.eval_batches(split):
        with autocast(trainer.amp_dtype, trainer.device):
            logits = model(batch).logits
        real = batch.tgt_out != pad
        logp = torch.log_softmax(logits.float()[real], dim=-1)  # (tokens, V)
        gold = batch.tgt_out[real]
        correct += int((logp.argmax(-1) == gold).sum())
        entropy -= float((logp.exp() * logp).sum())
        nll -= float(logp.gather(1, gold[:, None]).sum())
        n += int(real.sum())
    n = max(n, 1)
    return {"valid_token_acc": correct / n, "valid_entropy": entropy / n / math.log(2),
            "valid_nll": nll / n / math.log(2)}


def _has_probe(model: torch.nn.Module) -> bool:
    """Whether the model overrides :meth:`~nmtcore.models.NMTModel.usage_probe` (the default gathers nothing)."""
    return type(model).usage_probe is not NMTModel.usage_probe

