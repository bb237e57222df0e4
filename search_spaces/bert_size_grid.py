"""How big must the BERT be? BERT layers L × hidden size H (BERT-JAM, Table 6 / Fig. 3).

``full`` is the paper's 6 × 4 grid of Google's small BERTs; ``demo`` (the main job) is L ∈ {2, 4} ×
H ∈ {384, 768}, a grid whose every cell is a pretrained encoder even with no model hub. A size is given as
``model.bert.layers``/``model.bert.hidden`` (so ``model.bert.name`` is cleared) and resolved by
:func:`nmtcore.bert.resolve.offline_for_size`: Google's ``bert_uncased_L-{L}_H-{H}_A-{H/64}`` when the hub
answers, otherwise the bottom L layers of all-MiniLM-L6-v2 (H 384) or all-mpnet-base-v2 (H 768), or a
student distilled here for widths no packaged encoder has (weak: the report prints every cell's quality
figure). Offline, H therefore also changes the encoder family (MiniLM → MPNet), which the paper's grid does
not; the table names each cell's BERT. The model defaults to BERT-fused; entry points take ``--model``
(``bert_jam`` reproduces Table 6 itself).
"""

from nmtcore.sweep.space import Heatmap, SearchSpace, grid
from search_spaces.protocols import FUSION_DROPOUT, MULTI30K_TESTS, STAGE, STAGE_BUDGETS, WARM_START

STUDY = "bert_size_grid"
MODEL = "bert_fused"
LAYERS = (2, 4, 6, 8, 10, 12)
HIDDEN = (128, 256, 512, 768)
DEMO_LAYERS = (2, 4)
DEMO_HIDDEN = (384, 768)  # MiniLM's and MPNet's widths: real encoders on both axes with no hub
_common = dict(
    fixed={"model.bert.name": ""}, defaults={**MULTI30K_TESTS, **FUSION_DROPOUT}, protocol=WARM_START, budget=STAGE,
    budgets=STAGE_BUDGETS,
    plot=Heatmap(rows="model.bert.layers", cols="model.bert.hidden"),
    citation="Zhang et al. 2020, BERT-JAM, Table 6 / Fig. 3",
)

SPACES = {
    "full": SearchSpace(
        STUDY, "full", MODEL,
        params={"model.bert.layers": grid(LAYERS), "model.bert.hidden": grid(HIDDEN)},
        description="BERT size grid L x H = 6 x 4 (24 configurations, Google's small BERTs)", **_common),
    "demo": SearchSpace(
        STUDY, "demo", MODEL,
        params={"model.bert.layers": grid(DEMO_LAYERS), "model.bert.hidden": grid(DEMO_HIDDEN)},
        description="BERT size grid L in {2, 4} x H in {384, 768}: pretrained encoders in every cell", **_common),
}
DEFAULT = "demo"
