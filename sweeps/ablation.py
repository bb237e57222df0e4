"""Run one ablation study (BERT-JAM M0–M3, mask-fusion M0–M3, PLM-sponsored loss, document-context
integration or context type) and report every arm against the baseline with paired bootstrap p-values.

    python sweeps/ablation.py --study bert_jam [--seeds 3] [--smoke-test] [--resume] ...
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import ablations as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__, variant_flag="--study"))
