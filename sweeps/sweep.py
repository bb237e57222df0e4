"""Run any registered search space: ``--space study[:variant]`` (e.g. ``transformer_grid:demo``, the
sweep that exercises the platform on the registered Transformer baseline).

    python sweeps/sweep.py --space transformer_grid:demo [--smoke-test] [--resume] ...
"""

import argparse
import sys

import common
import search_spaces

if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--space", default="transformer_grid")
    known, rest = pre.parse_known_args()
    study, _, variant = known.space.partition(":")
    if study not in search_spaces.STUDIES:
        sys.exit(f"sweep.py: error: unknown study {study!r} (studies: {', '.join(search_spaces.STUDIES)})")
    parser = common.build_parser(__doc__.splitlines()[0], study, list(search_spaces.STUDIES[study]),
                                 variant or search_spaces.DEFAULT_VARIANT[study])
    parser.add_argument("--space", default=known.space, help="study[:variant]")
    sys.exit(common.main(study, parser.parse_args()))
