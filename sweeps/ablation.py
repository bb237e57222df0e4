"""Run one ablation study (BERT-JAM M0–M3, mask-fusion M0–M3, PLM-sponsored loss, document-context
integration or context type) and report every arm against the baseline with paired bootstrap p-values.

    python sweeps/ablation.py --study bert_jam [--seeds 3] [--smoke-test] [--resume] ...
"""

import sys

import common
from search_spaces import ablations as study

if __name__ == "__main__":
    args = common.build_parser(__doc__.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT,
                               variant_flag="--study", default_set=["model.bert.name=minilm"]).parse_args()
    sys.exit(common.main(study.STUDY, args))
