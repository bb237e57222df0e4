"""How much a trained model used BERT, measured on the validation set after training: what lets a report say
*why* an arm won or lost.

Three kinds of figure, each from a hook every model declares (:class:`~nmtcore.models.NMTModel`):

- ``valid_bleu/<switch>``: greedy validation BLEU under each of the model's inference switches
  (:meth:`~nmtcore.models.NMTModel.inference_switches`; BERT-fused: ``mix`` = Eq. 1, ``nmt_only``, ``bert_only``);
- ``bert_usage/<name>``: figures read off the weights (:meth:`~nmtcore.models.NMTModel.bert_usage`; BERT-JAM's GLU
  weight per BERT layer);
- ``probe/<name>``: figures gathered over one teacher-forced pass of the validation set
  (:meth:`~nmtcore.models.NMTModel.usage_probe`; document context: its gates' BERT share; mask fusion: the
  masked fraction).

A model without BERT has none of them and costs nothing here. The tracking callback logs them with the run
(metrics ``diag/...`` and ``diagnostics.json``), so a sweep's report reads them back per arm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nmtcore import bleu
from nmtcore.config import DecodeConfig
from nmtcore.devices import autocast
from nmtcore.models import NMTModel

if TYPE_CHECKING:
    from nmtcore.engine import Trainer

PREFIX = "diag/"  # the MLflow metric prefix of every figure here


@torch.no_grad()
def measure(trainer: "Trainer") -> dict[str, float]:
    """The model's diagnostics on the trainer's validation split, with the weights it holds now (after
    :meth:`~nmtcore.engine.trainer.Trainer.finalize_model`: the tested ones)."""
    model = trainer.model
    switches = model.inference_switches()
    usage = model.bert_usage()
    out: dict[str, float] = {}
    if not switches and not usage and not _has_probe(model):
        return out
    split = trainer.data.splits[trainer.cfg.data.valid_split]
    was_training = model.training
    model.eval()
    try:
        greedy = DecodeConfig(**{**trainer.cfg.decode.__dict__, "beam": 1, "nbest": 1})
        for name, switch in switches.items():
            with switch():
                hyps = trainer.translate(split, greedy)
            out[f"valid_bleu/{name}"] = bleu.corpus_bleu(hyps, split.raw_tgt).score
        out.update({f"bert_usage/{k}": float(v) for k, v in usage.items()})
        with model.usage_probe() as probe:
            for batch in trainer.eval_batches(split):
                with autocast(trainer.amp_dtype, trainer.device):
                    model(batch)
        out.update({f"probe/{k}": float(v) for k, v in probe.items()})
    finally:
        model.train(was_training)
    return out


def _has_probe(model: torch.nn.Module) -> bool:
    """Whether the model overrides :meth:`~nmtcore.models.NMTModel.usage_probe` (the default gathers nothing)."""
    return type(model).usage_probe is not NMTModel.usage_probe

