"""Sweep the distillation weight α (baseline+KD or PLM-sponsored; grid or Optuna) and plot BLEU against α.

    python sweeps/kd_alpha.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (the study's default; --set model.bert.name=... to change it).
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import kd_alpha as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__))
