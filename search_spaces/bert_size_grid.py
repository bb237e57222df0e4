"""How big must the BERT be? BERT layers L × hidden size H (BERT-JAM, Table 6 / Fig. 3).

``full`` is the paper's 6 × 4 grid; ``demo`` the 2 × 2 corner a 2-core machine finishes in an hour. A
size is given as ``model.bert.layers``/``model.bert.hidden`` (resolved to Google's
``bert_uncased_L-{L}_H-{H}_A-{H/64}`` when the hub is reachable, else to the platform's own pretrained
BERT of that size), so ``model.bert.name`` is cleared. The model defaults to BERT-fused; entry points
take ``--model`` (``bert_jam`` reproduces Table 6 itself).
"""

from nmtcore.sweep.space import Heatmap, SearchSpace, grid
from search_spaces.protocols import STAGE, WARM_START

STUDY = "bert_size_grid"
MODEL = "bert_fused"
LAYERS = (2, 4, 6, 8, 10, 12)
HIDDEN = (128, 256, 512, 768)
_common = dict(
    fixed={"model.bert.name": ""}, protocol=WARM_START, budget=STAGE,
    plot=Heatmap(rows="model.bert.layers", cols="model.bert.hidden"),
    citation="Zhang et al. 2020, BERT-JAM, Table 6 / Fig. 3",
)

SPACES = {
    "full": SearchSpace(
        STUDY, "full", MODEL,
        params={"model.bert.layers": grid(LAYERS), "model.bert.hidden": grid(HIDDEN)},
        description="BERT size grid L x H = 6 x 4 (24 configurations)", **_common),
    "demo": SearchSpace(
        STUDY, "demo", MODEL,
        params={"model.bert.layers": grid(LAYERS[:2]), "model.bert.hidden": grid(HIDDEN[:2])},
        description="BERT size grid, demo corner L in {2, 4} x H in {128, 256}", **_common),
}
DEFAULT = "demo"
