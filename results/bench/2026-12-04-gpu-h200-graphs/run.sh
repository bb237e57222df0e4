#!/bin/bash
# Device run: bench/gpu.py's graphs and trials sections from the checkout in .gpu/code; everything logged under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NMTCORE_DATA=$PWD/.gpu/data NMTCORE_CACHE=/tmp/nc NMTCORE_HOME=/tmp/nh NMTCORE_NO_PROGRESS=1 NMTCORE_OFFLINE=1
export PYTHONPATH=$PWD/.gpu/code
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu,clocks.sm --format=csv
python3 -c "import torch, transformers, sentencepiece, sacrebleu; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nproc; uptime
cd .gpu/code
python3 bench/gpu.py --data-dir $NMTCORE_DATA --out $OUT/gpu.jsonl --scratch /tmp/gpu --sections "${SECTIONS:-env,graphs,trials}" "$@" 2>&1 | tee $OUT/log.txt
echo "rc=$?"; uptime
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
