"""BERT-fused's drop-net rate p_net ∈ [0, 1] (Zhu et al. 2020): the probability of training a layer
through only its BERT-attention or only its encoder-attention branch instead of their average."""

from nmtcore.sweep.space import Curve, SearchSpace, grid, steps, uniform
from search_spaces.protocols import FUSION_DROPOUT, MINILM, MULTI30K_TESTS, STAGE, STAGE_BUDGETS, WARM_START

STUDY = "drop_net"
MODEL = "bert_fused"
KEY = "model.p_net"
DEFAULTS = {**MINILM, **MULTI30K_TESTS, **FUSION_DROPOUT}

SPACES = {
    "grid": SearchSpace(
        STUDY, "grid", MODEL, params={KEY: grid(steps(0.0, 1.0, 0.25))}, protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS,
        defaults=DEFAULTS, plot=Curve(KEY), citation="Zhu et al. 2020, Incorporating BERT into NMT, drop-net",
        description="drop-net rate p_net in {0, 0.25, 0.5, 0.75, 1}"),
    # Is it the stage or drop-net that leaves BERT-fused behind its control? Run on both budgets.
    "cause": SearchSpace(
        STUDY, "cause", MODEL, params={KEY: grid((0.0, 0.5, 1.0))}, protocol=WARM_START, budget=STAGE,
        budgets=STAGE_BUDGETS, defaults=DEFAULTS, plot=Curve(KEY),
        citation="Zhu et al. 2020, Incorporating BERT into NMT, drop-net",
        description="BERT-fused with p_net in {0, 0.5, 1} against the control (the cause experiment)"),
    # The original code gives the branch drop-net skips a zero gradient (it computes both and weights one by 0),
    # so Adam keeps moving it on its momentum; ours skipped it by default. Does that cost BLEU?
    "momentum": SearchSpace(
        STUDY, "momentum", MODEL, arms={"skipped branch: no gradient": {"model.drop_net_zero_grads": False},
                                        "skipped branch: zero gradient (original)": {"model.drop_net_zero_grads": True}},
        fixed={KEY: 1.0}, protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS, defaults=DEFAULTS,
        citation="Zhu et al. 2020, Incorporating BERT into NMT, drop-net; bert-nmt/bert-nmt",
        description="BERT-fused at p_net 1 with the skipped branch given no gradient or a zero gradient, against "
                    "the control"),
    "optuna": SearchSpace(
        STUDY, "optuna", MODEL, params={KEY: uniform(0.0, 1.0)}, num_samples=12, early_stopping=True,
        protocol=WARM_START, budget=STAGE, budgets=STAGE_BUDGETS, defaults=DEFAULTS, plot=Curve(KEY),
        description="drop-net rate p_net ~ U[0, 1], Optuna TPE + ASHA"),
}
DEFAULT = "grid"
