"""Does BERT help? Each fusion of the packaged MiniLM against the control: the same Transformer trained the
same way without BERT, both warm-started from the shared converged baseline (BERT-fused's procedure).

Evaluated on both Multi30k test sets; run with ``--seeds 3`` for a test across seeds.
"""

from nmtcore.sweep.space import CONTROL, Prediction, SearchSpace
from search_spaces.protocols import FUSION_DROPOUT, MINILM, MULTI30K_TESTS, QUICK_STAGE, STAGE, WARM_START

STUDY = "bert_benefit"
DEFAULTS = {**MINILM, **MULTI30K_TESTS, **FUSION_DROPOUT}
BUDGETS = {"converged": STAGE, "quick": {**QUICK_STAGE, "train.max_epochs": 5}}  # quick: its earlier 5 epochs

BERT_DROPOUT_WRITTEN = "2026-12-07 22:49"
BERT_DROPOUT_HYPOTHESIS = (
    "Row 1's arm loses to its control at dropout 0.3 because it trains on the same noise-free BERT states every "
    "epoch, where the authors' code gives them BERT's dropout; with BERT's dropout on it does not lose, and it gains "
    "at least half a BLEU on the same arm without it.")

SPACES = {
    "bert_fused": SearchSpace(
        STUDY, "bert_fused", "bert_fused", arms={"bert_fused": {"model.p_net": 1.0}}, protocol=WARM_START,
        budget=STAGE, budgets=BUDGETS, defaults=DEFAULTS, citation="Zhu et al. 2020, Incorporating BERT into NMT",
        description="BERT-fused (MiniLM, drop-net 1.0) vs the control, both warm-started from the baseline"),
    # Not the paper's: row 1's follow-up (docs/reproduction.md). The authors' fairseq leaves the frozen BERT's dropout
    # (0.1) on while it trains BERT-fused; the platform serves eval-mode states from its feature cache. The arm of
    # row 1 and the same arm with BERT's own dropout on (the cache is then off, BERT runs every step), against the
    # control, under row 1's protocol; each prediction written before any run of this study.
    "bert_dropout": SearchSpace(
        STUDY, "bert_dropout", "bert_fused", protocol=WARM_START, budget=STAGE, budgets=BUDGETS, defaults=DEFAULTS,
        arms={"bert_fused": {"model.p_net": 1.0},
              "bert_fused_bert_dropout": {"model.p_net": 1.0, "model.bert.dropout_when_frozen": True}},
        citation="Zhu et al. 2020, Incorporating BERT into NMT, with the authors' code's BERT dropout (not in the "
                 "paper)",
        description="BERT-fused with and without the frozen BERT's dropout in training, vs the control",
        predictions=tuple(Prediction("bert_fused_bert_dropout", measure, at_least=bound, against=against,
                                     written=BERT_DROPOUT_WRITTEN, hypothesis=BERT_DROPOUT_HYPOTHESIS)
                          for measure, bound, against in (("bleu:test_2016_flickr", -0.3, CONTROL),
                                                          ("bleu:test_2016_flickr", 0.5, "bert_fused")))),
}
DEFAULT = "bert_fused"
