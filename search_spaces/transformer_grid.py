"""The registered Transformer baseline's width × learning rate: the study that exercises the sweep
platform end to end before any BERT model exists, and a baseline-tuning study in its own right."""

from nmtcore.sweep.space import Heatmap, SearchSpace, grid, loguniform, uniform

STUDY = "transformer_grid"
# 4 short trials, 2 at a time on 2 cores (3 epochs of ~130 updates each); no protocol: this study tunes the
# baseline itself, so there is no control to compare with.
DEMO_BUDGET = {"train.max_epochs": 3, "train.warmup_updates": 100}

SPACES = {
    "demo": SearchSpace(
        STUDY, "demo", "transformer",
        params={"model.d_model": grid((128, 256)), "train.lr": grid((5e-4, 1e-3))},
        plot=Heatmap(rows="model.d_model", cols="train.lr"), budget=DEMO_BUDGET,
        description="Transformer d_model in {128, 256} x lr in {5e-4, 1e-3}"),
    "optuna": SearchSpace(
        STUDY, "optuna", "transformer",
        params={"train.lr": loguniform(2e-4, 2e-3), "model.dropout": uniform(0.0, 0.3)},
        num_samples=8, early_stopping=True,
        description="Transformer lr ~ logU[2e-4, 2e-3] x dropout ~ U[0, 0.3], Optuna TPE + ASHA"),
}
DEFAULT = "demo"
