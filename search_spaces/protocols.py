"""What the studies share: the offline BERT they default to, the two protocols, the arms' budget after a
warm start."""

from nmtcore.sweep.space import Protocol

# The BERT a study uses unless the user sets another: the packaged, offline all-MiniLM-L6-v2.
MINILM = {"model.bert.name": "minilm"}
# Arms and control start from the shared converged baseline (BERT-fused, document context, mask fusion; the
# baseline+KD Transformer): the papers' procedure.
WARM_START = Protocol()
# Arms and control train from scratch with the same budget (BERT-JAM and PLM-sponsored do in their papers).
FROM_SCRATCH = Protocol(warm_start=False)
# The second stage after a warm start: the learning-rate schedule restarts (warm-up included) at the
# baseline's rate, as the BERT-fused code does (it resets its scheduler); the budget is epochs.
STAGE = {"train.max_epochs": 3}
