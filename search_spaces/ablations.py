"""Ablation studies: each variant is a set of named arms (bundles of flat overrides) trained side by side
with a control arm (the Transformer without BERT, same budget); the report compares every arm to the control
with a paired bootstrap.

The arms switch explicit config fields, never model names (STYLE: no behaviour on name substrings).
The fields below are the ones the BERT models are specified to expose; until a model is registered its
study fails up front with "model '...' is not registered", and ``tests/test_search_spaces.py`` checks
every key against the real config class as soon as it is.

**BERT-JAM M0–M3 to convergence** (the default budget, ``converged``), at the paper's dropout 0.3 (arms and control;
a converged run at the platform's 0.1 overfit). The paper trains "until convergence in
the first two phases" (its 40/10/10 epochs on IWSLT'14 are what that took there) and stops phase 3 on the
validation loss, with the averaged window's lowest point in its middle. ``train.phases_converge`` runs every phase
until the platform's patience rule fires in it (counted from the phase's start: the baseline's rule, greedy
validation BLEU, patience 3, minimum gain 0.1, under the loss guard), then the next phase begins; phase 3's ends
the run. The tested weights average the last 6 epochs of phase 3 (``train.average_last``: twice the patience, so
the best epoch sits mid-window, as the paper's rule puts it). The control trains from scratch under the same rule
and averages its own last 6 epochs. Cap: 60 epochs a run (a run the cap stops is flagged, not converged). What it
costs on 2 cores: ``docs/reproduction.md``, row 4.

**BERT-JAM M0–M3 on a CPU budget** (``--budget scaled``, the earlier one). Every arm runs all of its phases (a
budget shorter than a schedule is refused, never cut): the paper's 40/10/10 epochs (M2, M3: 50/10) scaled by
``train.phase_scale=0.2`` to
8/2/2 (M2: 10/2 warm-up/fine-tune, M3: 10/2 GLU/fine-tune), 12 epochs per arm and at most 12 for the
control; checkpoint averaging of the last 2 epochs (the paper's 10, scaled alike) within the fine-tuning
phase; ``train.patience=1``, so phase 3 stops at its first epoch without a better validation loss (the paper
stops when the best epoch is mid-window: with a window of 2, one epoch after it; the control, which has no
phases, stops under the same rule). Each run records where its phases began and why the last one stopped
(``summary.json``: ``phase_starts``, ``stop_reason``; the ``phase`` epoch metric). Budget on 2 cores (1 thread per
trial, 2 trials at a time; Multi30k, multi30k_small sizes, MiniLM): 119 updates per epoch, measured per update
on a loaded machine at ~5 s (phases 1-2, cached BERT features) and ~10 s (phase 3, BERT fine-tuned) against
~4 s for the Transformer, i.e. about 2.3 h per BERT-JAM arm and 1.6 h for the control, about 5-6 h for
M0–M3 + control at one seed (about half on a quiet machine). The smoke test (``--smoke-test``, the study's
defaults only) runs a 4-epoch version (scale 0.05: 2/1/1) of this fixed protocol. A scale that leaves the
fine-tuning phase shorter than ``train.average_last`` (0.05 here) makes the arms test one epoch's weights and the
control an average of its last epochs: set ``train.average_last=1`` with it (the report warns; in
``results/studies/bert_jam-ablation-scale005`` averaging cost the control 1.0 BLEU).
"""

from nmtcore.sweep.space import Prediction, SearchSpace
from search_spaces.protocols import (FROM_SCRATCH, FUSION_DROPOUT, MINILM, MULTI30K_TESTS, SCRATCH, SCRATCH_BUDGETS,
                                     STAGE, STAGE_BUDGETS, WARM_START)

STUDY = "ablations"
DEFAULTS = {**MINILM, **MULTI30K_TESTS}
# The papers' dropout for the studies of models that fuse BERT into the Transformer (protocols.FUSION_DROPOUT; at 0.1
# BERT-JAM's M0 fit the training set better than its control and validated worse, docs/reproduction.md, row 4). In
# the defaults, so the control trains at it too and a resumed sweep keeps what it started with.
FUSION_DEFAULTS = {**DEFAULTS, **FUSION_DROPOUT}
# BERT-JAM's three phases on a CPU budget (see the module docstring). The smoke-sized version is the study's
# default (smoke tests keep defaults, not budgets); real runs take the budget, which overrides it.
BERT_JAM_SMOKE = {"train.phase_scale": 0.05, "train.max_epochs": 4, "train.average_last": 2, "train.patience": 1}
# The document-level data the offline machines have (nmtcore.data.corpus: maruf2019_devtest; docs/data.md).
DOC_DATA = {"data.corpus": "maruf2019_devtest", "data.valid_split": "valid", "data.test_splits": ["test"]}
BERT_JAM_BUDGET = {"train.phase_scale": 0.2, "train.max_epochs": 12, "train.average_last": 2, "train.keep_last": 3,
                   "train.patience": 1}
# Every phase until the patience rule fires in it (the paper's "until convergence"), the baseline's rule and cap;
# the last 6 epochs of phase 3 averaged (twice the patience: the best epoch mid-window). See the docstring.
BERT_JAM_CONVERGED = {**SCRATCH, "train.phases_converge": True, "train.phase_scale": 1.0, "train.average_last": 6,
                      "train.keep_last": 6}
BERT_JAM_BUDGETS = {"converged": BERT_JAM_CONVERGED, "scaled": BERT_JAM_BUDGET}

# PLM-sponsored's loss switches, one bundle per row of its Table 3 (the loss ablation's arms, below).
PLM_LOSS_ARMS = {
    arm: {"train.kd_alpha": 0.9 if kd else 1.0, "model.kd_teacher": kd, "model.kd_layer": layer,
          "model.mlm_loss": mlm, "model.tgt_lm_loss": lt}
    for arm, kd, layer, mlm, lt in (
        ("full", True, "half", True, True),  # Our Model
        ("no_mlm", True, "half", False, True),  # -L_MLM
        ("no_lt", True, "half", True, False),  # -L_T
        ("no_kd", False, "half", True, True),  # -L_kd
        ("no_mlm_kd", False, "half", False, True),  # -L_MLM & L_kd
        ("nmt_only", False, "half", False, False),  # -L_MLM & L_T & L_kd
        ("full_layer_kd", True, "full", True, True),  # +L_fkd - L_kd
    )
}


def m0_follow_up(name: str, arm: str, overrides: dict[str, object], citation: str, description: str, written: str,
                 hypothesis: str, bounds: tuple[tuple[str, float], ...]) -> SearchSpace:
    """A row-4 follow-up (not the paper's; its hypothesis in docs/reproduction.md): BERT-JAM's M0 changed by
    ``overrides`` as one arm, against the control under the ``bert_jam`` study's protocol, each prediction
    (``bounds``: measure, lowest value that holds) written before any run."""
    return SearchSpace(
        STUDY, name, "bert_jam", defaults={**FUSION_DEFAULTS, **BERT_JAM_SMOKE},
        budget=BERT_JAM_CONVERGED, budgets=BERT_JAM_BUDGETS, protocol=FROM_SCRATCH,
        arms={arm: {"model.name": "bert_jam", **overrides}},
        citation=f"Zhang et al. 2020, BERT-JAM, Table 7's M0 {citation} (not in the paper)", description=description,
        predictions=tuple(Prediction(arm, measure, at_least=bound, written=written, hypothesis=hypothesis)
                          for measure, bound in bounds))


SPACES = {
    # BERT-JAM M0–M3 (Table 7): each ablation is a registered model whose config is defined by its
    # fields (M1 glu=weighted_sum, M2 bert_layers=last without the GLU phase, M3 no warm-up phase).
    "bert_jam": SearchSpace(
        STUDY, "bert_jam", "bert_jam", defaults={**FUSION_DEFAULTS, **BERT_JAM_SMOKE}, budget=BERT_JAM_CONVERGED,
        budgets=BERT_JAM_BUDGETS, protocol=FROM_SCRATCH,
        arms={
            "M0_full": {"model.name": "bert_jam"},
            "M1_weighted_sum": {"model.name": "bert_jam_m1"},
            "M2_last_layer": {"model.name": "bert_jam_m2"},
            "M3_no_warmup": {"model.name": "bert_jam_m3"},
        },
        reference="M0_full", citation="Zhang et al. 2020, BERT-JAM, Table 7 (M0-M3)",
        description="BERT-JAM ablation: GLU layer fusion, all BERT layers, three-phase optimisation"),
    # Not the paper's: row 4's follow-up, its hypothesis and prediction in docs/reproduction.md. M0 with MiniLM's
    # bottom four layers, so its GLU reads layers 1-4 and starts on layer 4 (Eq. 11), not on the top layer that
    # all-MiniLM-L6-v2 trains for a pooled sentence embedding. One arm and the control under the study's protocol:
    # nmtcore report --sweep ablations-bert_jam-dropout03-m0 --sweep ablations-bert_jam_layer4 --against M0_full
    "bert_jam_layer4": m0_follow_up(
        "bert_jam_layer4", "M0_layer4", {"model.bert.name": "minilm:L4"}, "over another BERT's layers",
        "BERT-JAM M0 over MiniLM's bottom four layers instead of all six", "2026-12-05 22:14",
        "M0 loses because its GLU attends to MiniLM's top layer, trained for a pooled sentence embedding; over "
        "layers 1-4 it does not lose.", (("bleu:test_2016_flickr", -0.3),)),
    # Not the paper's: row 4's second follow-up (docs/reproduction.md). The authors' fairseq leaves the frozen BERT's
    # dropout on in phases 1-2, where the platform serves eval-mode features from its cache: M0 with BERT's own
    # dropout on while frozen (the cache is then off, BERT runs every step), against the control under the study's
    # protocol:
    # nmtcore report --sweep ablations-bert_jam-dropout03-m0 --sweep ablations-bert_jam_bert_dropout --against M0_full
    "bert_jam_bert_dropout": m0_follow_up(
        "bert_jam_bert_dropout", "M0_bert_dropout", {"model.bert.dropout_when_frozen": True},
        "with the authors' code's BERT dropout in phases 1-2",
        "BERT-JAM M0 with BERT's dropout on while it is frozen, as the authors' code runs it", "2026-12-06 00:04",
        "M0 fits the training set faster than its control because phases 1-2 feed it the same noise-free BERT states "
        "every epoch; with BERT's dropout on it does not.", (("fit:train_nll", 0.0), ("bleu:test_2016_flickr", -0.3))),
    # Not the paper's: row 4's third follow-up (docs/reproduction.md). The authors' code trains the decoder with
    # drop-net over Eq. 10's two joint attentions (one of them at random per layer; their average at inference), a
    # regularizer the platform leaves off to follow the paper's equation: M0 with it on, against the control under
    # the study's protocol:
    # nmtcore report --sweep ablations-bert_jam-dropout03-m0 --sweep ablations-bert_jam_decoder_drop_net --against M0_full
    "bert_jam_decoder_drop_net": m0_follow_up(
        "bert_jam_decoder_drop_net", "M0_decoder_drop_net", {"model.decoder_p_net": 1.0},
        "with the authors' code's decoder drop-net",
        "BERT-JAM M0 with drop-net over the decoder's two joint attentions, as the authors' code trains it",
        "2026-12-06 12:56",
        "M0 fits the training set better than its control and tests worse because its decoder always reads BERT "
        "beside the encoder; with the authors' decoder drop-net, which makes each layer do with one of the two, it "
        "fits less and does not lose.", (("fit:train_nll", -0.2), ("bleu:test_2016_flickr", -0.3))),
    # Mask fusion M0–M3 (Table 4): every arm sets all three switches (nmtcore.models.mask_fusion), so a
    # base config cannot leak one into another arm; θ stays the base's (0.03 by default).
    "mask_fusion": SearchSpace(
        STUDY, "mask_fusion", "mask_fusion", defaults=FUSION_DEFAULTS, protocol=WARM_START, budget=STAGE,
        budgets=STAGE_BUDGETS,
        arms={
            "M0_full": {"model.bert_layers": "all", "model.embedding_fusion": "mask",
                        "model.adaptive_fusion": True},
            "M1_last_layer": {"model.bert_layers": "last", "model.embedding_fusion": "mask",
                              "model.adaptive_fusion": True},
            "M2_no_mask_matrix": {"model.bert_layers": "all", "model.embedding_fusion": "gate",
                                  "model.adaptive_fusion": True},
            "M3_no_adaptive_fusion": {"model.bert_layers": "all", "model.embedding_fusion": "mask",
                                      "model.adaptive_fusion": False},
        },
        reference="M0_full", citation="two-stage interactive fusion (seed 004), Table 4 (M0-M3)",
        report_metrics=("valid_masked_fraction",),
        description="mask-fusion ablation: multi-layer BERT fusion, mask knowledge matrix, adaptive fusion"),
    # PLM-sponsored loss ablation (Table 3): L = (α·L_NMT + (1 − α)·L_KD) + L_MLM + L_T (Eq. 9). Every arm
    # sets every switch (nmtcore.models.plm_sponsored), so a base config cannot leak one into another arm;
    # train.kd_alpha is the weight of the NMT term (paper α = 0.9, which every KD arm trains), 1 = no L_KD
    # (and no teacher built). α stays out of the defaults: the control (a Transformer, no teacher) needs 1.
    # The paper's coordinator (12 layers; 6 in its En-De ablation) is a preset: --preset plm_sponsored_ablation_paper.
    "plm_sponsored_loss": SearchSpace(
        STUDY, "plm_sponsored_loss", "plm_sponsored", defaults=DEFAULTS, protocol=FROM_SCRATCH,
        budget=SCRATCH, budgets=SCRATCH_BUDGETS,
        arms=PLM_LOSS_ARMS,
        fixed={"model.bert.freeze": False},  # the source BERT is fine-tuned (base configs freeze it)
        reference="full", citation="PLM-sponsored NMT (seed 001), Table 3",
        description="PLM-sponsored loss ablation: MLM, target LM, half-layer KD (vs full-layer KD)"),
    # Not the paper's: row 9's follow-up, its hypothesis and prediction in docs/reproduction.md. The full model
    # with KD from MiniLM's layer 4, whose top layer is trained for a pooled sentence embedding rather than per
    # token. One arm and the loss ablation's control under its protocol, so the two sweeps pool:
    # nmtcore report --sweep ablations-plm_sponsored_loss --sweep ablations-plm_kd_teacher --against no_kd
    "plm_kd_teacher": SearchSpace(
        STUDY, "plm_kd_teacher", "plm_sponsored", defaults=DEFAULTS, protocol=FROM_SCRATCH,
        budget=SCRATCH, budgets=SCRATCH_BUDGETS,
        arms={"full_teacher_l4": {**PLM_LOSS_ARMS["full"], "model.kd_teacher_layer": 4}},
        fixed={"model.bert.freeze": False},
        citation="PLM-sponsored NMT (seed 001), Table 3's full model with another KD teacher layer (not in the paper)",
        description="PLM-sponsored full model, KD from MiniLM's layer 4 instead of its top layer",
        predictions=(Prediction("full_teacher_l4", "bleu:test_2016_flickr", at_least=-0.3, against="no_kd",
                                written="2026-12-05 15:28",
                                hypothesis="KD costs BLEU here because the teacher is MiniLM's top layer, trained "
                                           "for a pooled sentence embedding; from its layer 4 it does not."),)),
    # Document context (BERT as context encoder, seed 003): where C_B enters the model (Table 3)...
    # Both studies train on documents: by default the offline Maruf et al. sets (DOC_DATA); another document
    # corpus with --set data.corpus=docparallel data.data_dir=DIR and its splits.
    "doc_context_integration": SearchSpace(
        STUDY, "doc_context_integration", "doc_context", defaults={**DEFAULTS, **DOC_DATA}, protocol=WARM_START,
        budget=STAGE, budgets=STAGE_BUDGETS,
        # The paper's "none" row is the sentence-level Transformer: the control. An arm with integration "none"
        # would train the control again (the same function, parameters and draws: tests/test_doc_context.py).
        arms={
            "encoder": {"model.context_integration": "encoder"},
            "decoder": {"model.context_integration": "decoder"},
            "encoder_decoder": {"model.context_integration": "both"},
        },
        fixed={"model.context_type": "real"},
        citation="BERT as document-level context encoder (seed 003), Table 3",
        description="document-context integration: none (the sentence-level control), encoder, decoder, both"),
    # ...and which context BERT reads (Table 4, Li et al. 2020's protocol): the previous sentence of the
    # document, a sentence of random source-vocabulary words, or one fixed sentence.
    "doc_context_type": SearchSpace(
        STUDY, "doc_context_type", "doc_context", defaults={**DEFAULTS, **DOC_DATA}, protocol=WARM_START,
        budget=STAGE, budgets=STAGE_BUDGETS,
        arms={
            "context": {"model.context_type": "real"},
            "random": {"model.context_type": "random"},
            "fixed": {"model.context_type": "fixed"},
        },
        fixed={"model.context_integration": "both"},
        reference="context", citation="BERT as document-level context encoder (seed 003), Table 4",
        description="document-context type: previous sentence, random words, fixed sentence"),
}
DEFAULT = "bert_jam"
