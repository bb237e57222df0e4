"""Sweep the mask-fusion threshold θ (the paper's grid 0–0.05, or Optuna over a range) and plot BLEU against θ.

    python sweeps/mask_threshold.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (--set model.bert.name=... to change it).
"""

import sys

import common
from search_spaces import mask_threshold as study

if __name__ == "__main__":
    args = common.build_parser(__doc__.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT,
                               default_set=["model.bert.name=minilm"]).parse_args()
    sys.exit(common.main(study.STUDY, args))
