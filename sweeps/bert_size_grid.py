"""How big must the BERT be? Sweep BERT layers × hidden size (BERT-JAM Table 6) and report the BLEU
heatmap. Default: the 2 × 2 ``demo`` corner on Multi30k En→De, 1 seed, on a local Ray cluster.

    python sweeps/bert_size_grid.py                    # demo grid, real data
    python sweeps/bert_size_grid.py --variant full --seeds 3 --address HEAD:6379 --tracking-uri http://HOST:5000
    python sweeps/bert_size_grid.py --smoke-test       # 2 tiny trials on synthetic data
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import bert_size_grid as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__))
