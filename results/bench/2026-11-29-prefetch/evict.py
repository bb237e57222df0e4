"""Drop the frozen-feature cache files from the page cache (no root needed), so the next run reads them cold.

  python results/bench/2026-11-29-prefetch/evict.py [CACHE_DIR]   (default: $NMTCORE_CACHE or ~/.cache/nmtcore)
"""

import glob
import os
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("NMTCORE_CACHE", "~/.cache/nmtcore")).expanduser()
for p in glob.glob(str(root / "bert_features" / "*" / "features.npy")):
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    print("evicted", p)
