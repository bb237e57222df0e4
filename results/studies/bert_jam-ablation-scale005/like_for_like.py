"""The control of this run was tested on the average of its epochs 3 and 4 (train.average_last=2 over its one
implicit phase), every BERT-JAM arm on its epoch-4 weights alone (its last phase, fine-tuning, was 1 epoch at
train.phase_scale=0.05, so averaging was skipped). This compares like with like: the control's epoch-4 weights,
decoded with the sweep's own code and decoding settings, against each arm's test hypotheses (paired bootstrap,
1000 resamples, as the report).

    T=<the control trial's checkpoints dir>   # .../trials/0434b9ff79b0/checkpoints (see console.log)
    zcat $NMTCORE_DATA/multi30k/test_2016_flickr.en.gz > /tmp/t16.en
    zcat $NMTCORE_DATA/multi30k/test_2016_flickr.de.gz > /tmp/t16.de
    PYTHONPATH=<a worktree of 08a47e3> python -m nmtcore.cli translate --checkpoint $T/epoch4.pt \
        --input /tmp/t16.en --output /tmp/control_epoch4.de
    python results/studies/bert_jam-ablation-scale005/like_for_like.py /tmp/control_epoch4.de /tmp/t16.de
"""

import sys

from nmtcore import bleu, tracking
from nmtcore.sweep.lifecycle import ARM_TAG, find_sweep_run, sweep_children

URI = "sqlite:////work/runs/home/mlflow.db"
control_hyps, refs = (open(p, encoding="utf-8").read().splitlines() for p in sys.argv[1:3])
print(f"control, epoch 4 alone: BLEU {bleu.corpus_bleu(control_hyps, refs).score:.2f}")
parent = find_sweep_run("bert_jam-ablation-scale005", URI)
for run in sweep_children(parent.run_id, URI):
    arm = run.tags.get(ARM_TAG)
    hyps = tracking.read_artifact_text(run.run_id, "hypotheses/test_2016_flickr.de", URI).splitlines()
    r = bleu.paired_bootstrap(control_hyps, hyps, refs)
    print(f"{arm}: BLEU {r.score_b:.2f}  Δ vs control epoch 4 {r.diff:+.2f} "
          f"[{r.ci_diff[0]:+.2f}, {r.ci_diff[1]:+.2f}] p (two-sided) {r.p_value_two_sided:.3f}")
