"""The mask-fusion model's threshold θ: the paper's grid 0–0.05 in steps of 0.01 (Table 5), or a continuous
range searched by Optuna (TPE) with ASHA early stopping.

The mask selects by content: Eq. 3's scores are scaled by √d (``model.mask_scale``; ``d`` would flatten the
softmax to ≈ 1/length and mask by length), and w1, b learn through a straight-through estimator
(``model.mask_estimator``). Every trial reports, per epoch, the fraction of validation source tokens its
mask removes (``valid_masked_fraction``, in MLflow and Tune's results), so the θ table shows what each θ
masked beside its BLEU. At the seeded initialisation on Multi30k (MiniLM, multi30k_small) that fraction is
about 0, 0.002, 0.03, 0.10 and 0.24 for θ = 0.01 … 0.05 (``tests/test_mask_fusion.py``); training moves it.
"""

from nmtcore.sweep.space import Curve, SearchSpace, grid, steps, uniform
from search_spaces.protocols import FUSION_DROPOUT, MINILM, MULTI30K_TESTS, STAGE, STAGE_BUDGETS, WARM_START

STUDY = "mask_threshold"
MODEL = "mask_fusion"
KEY = "model.mask_threshold"
DEFAULTS = {**MINILM, **MULTI30K_TESTS, **FUSION_DROPOUT}
MASKED = ("valid_masked_fraction",)  # the report's column beside BLEU: what each θ masked

SPACES = {
    "paper": SearchSpace(
        STUDY, "paper", MODEL, params={KEY: grid(steps(0.0, 0.05, 0.01))}, protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS,
        defaults=DEFAULTS, plot=Curve(KEY), citation="two-stage interactive fusion (seed 004), Table 5",
        report_metrics=MASKED,
        description="mask threshold θ in {0, 0.01, ..., 0.05} (the paper's grid)"),
    "optuna": SearchSpace(
        STUDY, "optuna", MODEL, params={KEY: uniform(0.0, 0.05)}, num_samples=12, early_stopping=True,
        protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS, defaults=DEFAULTS, plot=Curve(KEY), report_metrics=MASKED,
        description="mask threshold θ ~ U[0, 0.05], Optuna TPE + ASHA"),
}
DEFAULT = "paper"
