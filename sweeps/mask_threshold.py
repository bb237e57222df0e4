"""Sweep the mask-fusion threshold θ (the paper's grid 0–0.05, or Optuna over a range) and plot BLEU against θ.

    python sweeps/mask_threshold.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (the study's default; --set model.bert.name=... to change it).
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import mask_threshold as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__))
