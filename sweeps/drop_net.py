"""Sweep BERT-fused's drop-net rate p_net in [0, 1] (grid, or Optuna) and plot BLEU against p_net.

    python sweeps/drop_net.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (the study's default; --set model.bert.name=... to change it).
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import drop_net as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__))
