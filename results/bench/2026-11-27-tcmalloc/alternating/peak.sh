export NMTCORE_DATA=/work/shared/data NMTCORE_CACHE=/work/runs/cache NMTCORE_HOME=/work/runs/home NMTCORE_NO_PROGRESS=1 RAY_USAGE_STATS_ENABLED=0 NMTCORE_OFFLINE=1
cd /work/main
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
T=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
for alloc in glibc jemalloc tcmalloc; do
  case $alloc in glibc) P=;; jemalloc) P=$J;; tcmalloc) P=$T;; esac
  for case in baseline plm_sponsored; do
    echo "== $alloc $case $(date +%T)"
    LD_PRELOAD=$P python bench/finetune_memory.py --case $case --checkpointing 1 --data-dir /work/shared/data --threads 2 --updates 10 2>&1 | grep RESULT
  done
done
