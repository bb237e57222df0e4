"""How big must the BERT be? Sweep BERT layers × hidden size (BERT-JAM Table 6) and report the BLEU
heatmap. Default: the 2 × 2 ``demo`` corner on Multi30k En→De, 1 seed, on a local Ray cluster.

    python sweeps/bert_size_grid.py                    # demo grid, real data
    python sweeps/bert_size_grid.py --variant full --seeds 3 --address HEAD:6379 --tracking-uri http://HOST:5000
    python sweeps/bert_size_grid.py --smoke-test       # 2 tiny trials on synthetic data
"""

import sys

import common
from search_spaces import bert_size_grid as study

if __name__ == "__main__":
    args = common.build_parser(__doc__.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT,
                               default_model=study.MODEL).parse_args()
    sys.exit(common.main(study.STUDY, args))
