"""Drop the page cache's copy of every cached BERT feature file (posix_fadvise DONTNEED), so the next read comes from
disk: python results/bench/2026-11-29-short-softmax/evict.py (reads NMTCORE_CACHE, default ~/.cache/nmtcore)."""
import glob
import os

root = os.environ.get("NMTCORE_CACHE", os.path.expanduser("~/.cache/nmtcore"))
for f in glob.glob(os.path.join(root, "bert_features", "*", "features.npy")):
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
print("evicted")
