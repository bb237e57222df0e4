"""Sweep BERT-fused's drop-net rate p_net in [0, 1] (grid, or Optuna) and plot BLEU against p_net.

    python sweeps/drop_net.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (--set model.bert.name=... to change it).
"""

import sys

import common
from search_spaces import drop_net as study

if __name__ == "__main__":
    args = common.build_parser(__doc__.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT,
                               default_set=["model.bert.name=minilm"]).parse_args()
    sys.exit(common.main(study.STUDY, args))
