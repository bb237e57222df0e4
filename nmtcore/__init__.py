"""nmtcore: a sweep and ablation platform for BERT-enhanced neural machine translation."""

__version__ = "0.1.0"
