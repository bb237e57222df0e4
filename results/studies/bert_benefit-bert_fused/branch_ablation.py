"""Which branch a trained BERT-fused model translates with: its validation BLEU (greedy) with drop-net's
inference weights forced to the average of the two branches (Eq. 1, what the model is tested with), to the
NMT branches only (self-attention in the encoder, encoder-decoder attention in the decoder: BERT switched
off) and to the BERT branches only.

    python results/studies/bert_benefit-bert_fused/branch_ablation.py --data-dir ../shared/data CHECKPOINT [...]
"""

import argparse
import gzip
from pathlib import Path

import torch

from nmtcore import bleu
from nmtcore.decoding import load_translator

MODES = {  # (encoder (attn_S, attn_B), decoder (attn_B, attn_E))
    "average (Eq. 1)": ((0.5, 0.5), (0.5, 0.5)),
    "NMT branches only": ((1.0, 0.0), (0.0, 1.0)),
    "BERT branches only": ((0.0, 1.0), (1.0, 0.0)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    corpus = args.data_dir / "multi30k"
    src = gzip.open(corpus / "val.en.gz", "rt", encoding="utf-8").read().splitlines()
    ref = gzip.open(corpus / "val.de.gz", "rt", encoding="utf-8").read().splitlines()
    for path in args.checkpoints:
        translator = load_translator(path, {"decode.beam": 1})
        model = translator.model
        for name, (enc, dec) in MODES.items():
            model.enc_drop_net.weights = lambda w=enc: w  # eval-mode weights, per stack
            model.dec_drop_net.weights = lambda w=dec: w
            score = bleu.corpus_bleu(translator.translate(src), ref).score
            print(f"{path}: {name}: valid BLEU {score:.2f}", flush=True)


if __name__ == "__main__":
    main()
