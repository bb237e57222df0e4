"""Sweep the distillation weight α (baseline+KD or PLM-sponsored; grid or Optuna) and plot BLEU against α.

    python sweeps/kd_alpha.py [--variant V] [--smoke-test] [--resume] [--seeds N] ...

The BERT defaults to the packaged, offline ``minilm`` (--set model.bert.name=... to change it).
"""

import sys

import common
from search_spaces import kd_alpha as study

if __name__ == "__main__":
    args = common.build_parser(__doc__.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT,
                               default_set=["model.bert.name=minilm"]).parse_args()
    sys.exit(common.main(study.STUDY, args))
