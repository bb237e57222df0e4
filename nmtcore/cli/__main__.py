"""``python -m nmtcore.cli``: the ``nmtcore`` command."""

import sys

from nmtcore.cli.main import main

sys.exit(main())
