export NMTCORE_DATA=/work/shared/data NMTCORE_CACHE=/work/runs/cache NMTCORE_HOME=/work/runs/home NMTCORE_NO_PROGRESS=1 RAY_USAGE_STATS_ENABLED=0 NMTCORE_OFFLINE=1
cd /work/main
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
T=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
run() { case $1 in glibc) P=;; jemalloc) P=$J;; tcmalloc) P=$T;; esac
  echo "== $1 $2 $(date +%T)"
  LD_PRELOAD=$P python bench/finetune_memory.py --case $2 --checkpointing 1 --data-dir /work/shared/data --threads 2 --updates $3 2>&1 | tail -3; }
run tcmalloc baseline 16
for r in 1 2; do for a in glibc tcmalloc; do run $a plm_sponsored 5; done; done
