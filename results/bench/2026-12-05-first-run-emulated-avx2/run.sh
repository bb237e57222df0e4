#!/bin/bash
# The main job from a clean cache with AVX2 kernels only, on this AVX512/AMX host (an emulation, not an AVX2
# machine): /proc/cpuinfo without the avx512*/amx* flags (nmtcore picks fp32 from it), ATen, oneDNN and MKL
# limited to AVX2. Stops the sweep with SIGINT once the baseline's first training line is on the console.
# usage: run.sh OUTDIR [extra sweep args]
set -u
OUT=$1; shift
rm -rf "$OUT"; mkdir -p "$OUT"
sed 's/ avx512[a-z0-9_]*//g; s/ amx[a-z0-9_]*//g' /proc/cpuinfo > "$OUT/cpuinfo"
cd /work/wt
unshare --mount bash -c "
mount --bind '$OUT/cpuinfo' /proc/cpuinfo
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export NMTCORE_CACHE='$OUT/cache' NMTCORE_DATA=/work/shared/data PYTHONPATH=/work/wt
echo \"\$(date +%H:%M:%S) command started: python sweeps/bert_size_grid.py $*\"
python sweeps/bert_size_grid.py --tracking-uri sqlite:///$OUT/mlflow.db --storage $OUT/ray --baseline-store $OUT/baselines --name first-avx2 $* 2>&1 | while IFS= read -r l; do printf '%s %s\n' \"\$(date +%H:%M:%S)\" \"\$l\"; done
" > "$OUT/console.log" 2>&1 &
PID=$!
if [ "$*" = "--dry-run" ]; then wait $PID; exit; fi
for i in $(seq 1 1200); do
  if grep -q "train baseline .*: epoch 1 update" "$OUT/console.log"; then break; fi
  sleep 1
done
sleep 2
pkill -INT -f "sweeps/bert_size_grid.py --tracking-uri sqlite:///$OUT" 
wait $PID
