"""The knowledge-distillation weight α of L = α·L_NMT + (1 − α)·L_KD (``train.kd_alpha``; 1 = no KD), for a
Transformer distilled from a BERT teacher (baseline+KD) and for the PLM-sponsored model.

The baseline+KD teacher is the study's BERT (the packaged MiniLM by default); its control is the same
Transformer without a teacher (α = 1), warm-started from the same baseline. The grids include the
PLM-sponsored paper's α = 0.9 (Eq. 5); every trial sets α, so the study's defaults leave it at 1 (its
control, a Transformer without a teacher, must train without KD). The paper's own PLM-sponsored setting
(α = 0.9, 12-layer coordinator, PLM dropout 0.5) is ``--preset plm_sponsored_iwslt_paper``.
"""

from nmtcore.sweep.space import Curve, SearchSpace, grid, uniform
from search_spaces.protocols import (FROM_SCRATCH, MINILM, MULTI30K_TESTS, SCRATCH, SCRATCH_BUDGETS, STAGE,
                                     STAGE_BUDGETS, WARM_START)

STUDY = "kd_alpha"
KEY = "train.kd_alpha"
DEFAULTS = {**MINILM, **MULTI30K_TESTS}
# α = 1 (no KD) is the control arm: a teacher built and not used is refused for the baseline+KD Transformer.
_KD_GRID = grid((0.0, 0.2, 0.4, 0.6, 0.8, 0.9))
# PLM-sponsored (Eq. 5, α = 0.9 in the paper): KEY is the weight of the NMT term (the public code's α weighs
# the KD term: its 0.1 is our 0.9). Its source BERT is fine-tuned (base configs freeze it) and the half-layer
# teacher is built for every α (idle at α = 1); MLM and L_T stay on, as in the paper's full model.
_PLM = {"model.bert.freeze": False, "model.kd_teacher": True, "model.kd_layer": "half"}
_PLM_GRID = grid((0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0))

SPACES = {
    "baseline_kd": SearchSpace(
        STUDY, "baseline_kd", "transformer", params={KEY: _KD_GRID}, protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS,
        defaults=DEFAULTS, plot=Curve(KEY), citation="CTNMT (Yang et al. 2020); PLM-sponsored NMT Eq. 4-5",
        description="baseline Transformer + KD from BERT, alpha in {0, 0.2, ..., 0.8, 0.9} vs alpha = 1 (control)"),
    "baseline_kd_optuna": SearchSpace(
        STUDY, "baseline_kd_optuna", "transformer", params={KEY: uniform(0.0, 0.95)}, num_samples=12,
        early_stopping=True, protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS, defaults=DEFAULTS, plot=Curve(KEY),
        description="baseline Transformer + KD from BERT, alpha ~ U[0, 0.95], Optuna TPE + ASHA"),
    "plm_sponsored": SearchSpace(
        STUDY, "plm_sponsored", "plm_sponsored", params={KEY: _PLM_GRID}, fixed=_PLM, protocol=FROM_SCRATCH,
        budget=SCRATCH, budgets=SCRATCH_BUDGETS, defaults=DEFAULTS, plot=Curve(KEY), citation="PLM-sponsored NMT (seed 001), Eq. 5",
        description="PLM-sponsored model, alpha in {0, 0.2, ..., 0.8, 0.9, 1}"),
    "plm_sponsored_optuna": SearchSpace(
        STUDY, "plm_sponsored_optuna", "plm_sponsored", params={KEY: uniform(0.0, 1.0)}, fixed=_PLM,
        num_samples=12, early_stopping=True, protocol=FROM_SCRATCH, budget=SCRATCH, budgets=SCRATCH_BUDGETS,
        defaults=DEFAULTS, plot=Curve(KEY),
        description="PLM-sponsored model, alpha ~ U[0, 1], Optuna TPE + ASHA"),
}
DEFAULT = "baseline_kd"
