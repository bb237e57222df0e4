"""Does BERT help? BERT-fused with the packaged MiniLM against the control (the Transformer trained the same
way without BERT), both warm-started from the shared converged baseline; both Multi30k test sets.

    python sweeps/bert_benefit.py [--seeds 3] [--smoke-test] [--resume] ...
"""

import sys

from nmtcore.cli.sweep import entry_point
from search_spaces import bert_benefit as study

if __name__ == "__main__":
    sys.exit(entry_point(study, __doc__))
