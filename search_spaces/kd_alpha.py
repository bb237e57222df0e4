"""The knowledge-distillation weight α of L = α·L_NMT + (1 − α)·L_KD (``train.kd_alpha``; 1 = no KD),
for a Transformer distilled from a BERT teacher (baseline+KD) and for the PLM-sponsored model.

The baseline+KD teacher is a BERT-base-sized BERT (``model.bert`` 12 × 768); the report's p-values are
against α = 1, i.e. training without distillation.
"""

from search_spaces.spec import Curve, SearchSpace, grid, steps, uniform

STUDY = "kd_alpha"
KEY = "train.kd_alpha"
_TEACHER = {"model.bert.name": "", "model.bert.layers": 12, "model.bert.hidden": 768}
_GRID = grid(steps(0.0, 1.0, 0.2))
# PLM-sponsored (Eq. 5, α = 0.9 in the paper): KEY is the weight of the NMT term (the public code's α weighs
# the KD term: its 0.1 is our 0.9). Its source BERT is fine-tuned (base configs freeze it) and the half-layer
# teacher is built for every α (idle at α = 1); MLM and L_T stay on, as in the paper's full model.
_PLM = {"model.bert.freeze": False, "model.kd_teacher": True, "model.kd_layer": "half"}

SPACES = {
    "baseline_kd": SearchSpace(
        STUDY, "baseline_kd", "transformer", params={KEY: _GRID}, fixed=_TEACHER, baseline={KEY: 1.0},
        plot=Curve(KEY), description="baseline Transformer + KD from BERT, alpha in {0, 0.2, ..., 1}"),
    "baseline_kd_optuna": SearchSpace(
        STUDY, "baseline_kd_optuna", "transformer", params={KEY: uniform(0.0, 1.0)}, fixed=_TEACHER,
        num_samples=12, early_stopping=True, plot=Curve(KEY),
        description="baseline Transformer + KD from BERT, alpha ~ U[0, 1], Optuna TPE + ASHA"),
    "plm_sponsored": SearchSpace(
        STUDY, "plm_sponsored", "plm_sponsored", params={KEY: _GRID}, fixed=_PLM, baseline={KEY: 1.0}, plot=Curve(KEY),
        description="PLM-sponsored model, alpha in {0, 0.2, ..., 1}"),
    "plm_sponsored_optuna": SearchSpace(
        STUDY, "plm_sponsored_optuna", "plm_sponsored", params={KEY: uniform(0.0, 1.0)}, fixed=_PLM, num_samples=12,
        early_stopping=True, plot=Curve(KEY), description="PLM-sponsored model, alpha ~ U[0, 1], Optuna TPE + ASHA"),
}
DEFAULT = "baseline_kd"
