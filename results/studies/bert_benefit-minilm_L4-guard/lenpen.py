"""Is the arm's gain only length? Each trial's tested weights decoded again with the length penalty chosen on the
validation set, then the same paired comparison on the test sets.

For every trial of the study: beam 5 over Multi30k val with ``decode.lenpen`` in LENPENS (fairseq semantics: a
hypothesis scores log-probability / length ** lenpen; the study decoded at 1.0), the lenpen with the best
validation BLEU kept for that model, then test_2016_flickr and test_2017_flickr decoded with it. The arm and the
control are compared as the report compares them: seeds pooled (the three seeds' hypotheses one after another
against the references repeated), paired bootstrap, 1000 resamples (``nmtcore evaluate --against``).

  python results/studies/bert_benefit-minilm_L4-guard/lenpen.py \
      --trials runs/sweeps/bert_benefit-minilm_L4-guard/trials --data-dir ../shared/data

Writes ``lenpen.json`` and prints a table. The trial folders are the sweep's (``trials/<key>/checkpoints``):
which is which comes from TRIALS below (the report's runs, by stop and best epoch).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LENPENS = (0.6, 1.0, 1.4, 1.8, 2.4)
# trial key -> (arm, seed, tested epoch): from the sweep's runs (stopped after / best epoch in README.md)
TRIALS = {
    "d158bcd5b855": ("control", 4, 9), "a3f0757d24f6": ("control", 5, 1), "e1b8de5b3821": ("control", 6, 7),
    "f3c49550b1ef": ("bert_fused", 4, 16), "e6b03e73af7a": ("bert_fused", 5, 9), "bcb75beae6d7": ("bert_fused", 6, 9),
}
SPLITS = ("val", "test_2016_flickr", "test_2017_flickr")


def run_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])


def translate(ckpt: Path, src: Path, out: Path, lenpen: float) -> None:
    subprocess.run(["nmtcore", "translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                    "--set", f"decode.lenpen={lenpen}"], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lenpen-"))
    text = {}
    for split in SPLITS:
        for lang in ("en", "de"):
            path = work / f"{split}.{lang}"
            path.write_bytes(gzip.decompress((args.data_dir / "multi30k" / f"{split}.{lang}.gz").read_bytes()))
            text[split, lang] = path
    models = {}
    for key, (arm, seed, epoch) in TRIALS.items():
        ckpt = args.trials / key / "checkpoints" / f"epoch{epoch}.pt"
        val = {}
        for lp in LENPENS:
            hyp = work / f"{key}.val.{lp}"
            translate(ckpt, text["val", "en"], hyp, lp)
            s = run_json(["nmtcore", "evaluate", "--hyp", str(hyp), "--ref", str(text["val", "de"])])
            val[lp] = {"bleu": s["bleu"], "len_ratio": s["sys_len"] / s["ref_len"]}
        best = max(LENPENS, key=lambda lp: val[lp]["bleu"])
        test = {}
        for split in SPLITS[1:]:
            hyp = work / f"{key}.{split}"
            translate(ckpt, text[split, "en"], hyp, best)
            s = run_json(["nmtcore", "evaluate", "--hyp", str(hyp), "--ref", str(text[split, "de"])])
            test[split] = {"bleu": s["bleu"], "bp": s["bp"], "len_ratio": s["sys_len"] / s["ref_len"], "hyp": str(hyp)}
        models[key] = {"arm": arm, "seed": seed, "epoch": epoch, "val": val, "lenpen": best, "test": test}
        print(f"{arm} seed {seed}: lenpen {best} (val BLEU " + ", ".join(
            f"{lp}: {v['bleu']:.2f} @ {v['len_ratio']:.3f}" for lp, v in val.items()) + ")", flush=True)
    pooled = {}
    for split in SPLITS[1:]:
        ref = work / f"pooled.ref.{split}"
        ref.write_text(text[split, "de"].read_text() * 3)
        for decoding in ("study (lenpen 1.0)", "lenpen chosen on val"):
            hyps = {}
            for arm in ("control", "bert_fused"):
                keys = sorted((k for k, m in models.items() if m["arm"] == arm), key=lambda k: models[k]["seed"])
                files = [args.trials / k / "hyps" / f"{split}.de" if decoding.startswith("study")
                         else Path(models[k]["test"][split]["hyp"]) for k in keys]
                hyps[arm] = work / f"pooled.{arm}.{split}.{len(pooled)}"
                hyps[arm].write_text("".join(f.read_text() for f in files))
            c = run_json(["nmtcore", "evaluate", "--hyp", str(hyps["bert_fused"]), "--ref", str(ref),
                          "--against", str(hyps["control"])])
            a = c["against"]
            pooled[f"{split}, {decoding}"] = {
                "control": {"bleu": a["bleu"], "bp": a["bp"]}, "bert_fused": {"bleu": c["bleu"], "bp": c["bp"]},
                "delta": a["delta"], "ci95": a["ci95"], "p": a["p"]}
            print(f"{split}, {decoding}: control {a['bleu']:.2f} (BP {a['bp']:.3f}), bert_fused {c['bleu']:.2f} "
                  f"(BP {c['bp']:.3f}), delta {a['delta']:+.2f} [{a['ci95'][0]:+.2f}, {a['ci95'][1]:+.2f}] "
                  f"p {a['p']:.3f}", flush=True)
    for m in models.values():
        for t in m["test"].values():
            del t["hyp"]
    (HERE / "lenpen.json").write_text(json.dumps({"lenpens": LENPENS, "models": models, "pooled": pooled},
                                                 indent=2) + "\n")


if __name__ == "__main__":
    main()
