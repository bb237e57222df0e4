"""The mask-fusion model's threshold θ: the paper's grid 0–0.05 in steps of 0.01, or a continuous
range searched by Optuna (TPE) with ASHA early stopping."""

from nmtcore.sweep.space import Curve, SearchSpace, grid, steps, uniform
from search_spaces.protocols import MINILM, STAGE, WARM_START

STUDY = "mask_threshold"
MODEL = "mask_fusion"
KEY = "model.mask_threshold"
DEFAULTS = MINILM

SPACES = {
    "paper": SearchSpace(
        STUDY, "paper", MODEL, params={KEY: grid(steps(0.0, 0.05, 0.01))}, protocol=WARM_START, budget=STAGE,
        defaults=DEFAULTS, plot=Curve(KEY), citation="two-stage interactive fusion (seed 004), Table 5",
        description="mask threshold θ in {0, 0.01, ..., 0.05} (the paper's grid)"),
    "optuna": SearchSpace(
        STUDY, "optuna", MODEL, params={KEY: uniform(0.0, 0.05)}, num_samples=12, early_stopping=True,
        protocol=WARM_START, budget=STAGE, defaults=DEFAULTS, plot=Curve(KEY),
        description="mask threshold θ ~ U[0, 0.05], Optuna TPE + ASHA"),
}
DEFAULT = "paper"
