"""Does BERT help? Each fusion of the packaged MiniLM against the control: the same Transformer trained the
same way without BERT, both warm-started from the shared converged baseline (BERT-fused's procedure).

Evaluated on both Multi30k test sets; run with ``--seeds 3`` for a test across seeds.
"""

from nmtcore.sweep.space import SearchSpace
from search_spaces.protocols import FUSION_DROPOUT, MINILM, MULTI30K_TESTS, QUICK_STAGE, STAGE, WARM_START

STUDY = "bert_benefit"
DEFAULTS = {**MINILM, **MULTI30K_TESTS, **FUSION_DROPOUT}
BUDGETS = {"converged": STAGE, "quick": {**QUICK_STAGE, "train.max_epochs": 5}}  # quick: its earlier 5 epochs

SPACES = {
    "bert_fused": SearchSpace(
        STUDY, "bert_fused", "bert_fused", arms={"bert_fused": {"model.p_net": 1.0}}, protocol=WARM_START,
        budget=STAGE, budgets=BUDGETS, defaults=DEFAULTS, citation="Zhu et al. 2020, Incorporating BERT into NMT",
        description="BERT-fused (MiniLM, drop-net 1.0) vs the control, both warm-started from the baseline"),
}
DEFAULT = "bert_fused"
