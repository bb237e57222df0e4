"""Run any registered search space: ``--space study[:variant]`` (e.g. ``transformer_grid:demo``, the
sweep that exercises the platform on the registered Transformer baseline).

    python sweeps/sweep.py --space transformer_grid:demo [--smoke-test] [--resume] ...
"""

import argparse
import sys

import search_spaces
from nmtcore.cli.sweep import build_parser, main

if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--space", default="transformer_grid")
    known, _ = pre.parse_known_args()
    name, _, variant = known.space.partition(":")
    if name not in search_spaces.STUDIES:
        sys.exit(f"sweep.py: error: unknown study {name!r} (studies: {', '.join(search_spaces.STUDIES)})")
    study = search_spaces.MODULES[name]
    parser = build_parser(__doc__.splitlines()[0], name, list(study.SPACES), variant or study.DEFAULT)
    parser.add_argument("--space", default=known.space, help="study[:variant]")
    sys.exit(main(study, parser.parse_args()))
