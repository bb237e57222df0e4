"""What the platform does on one CUDA GPU, measured in one run: the model zoo's contract on the GPU, training
throughput (fp32 / bf16, eager / compiled / CUDA graphs, the trainer's batches and 4x larger ones) against a bare
``torch.nn.Transformer`` of the same size, several trials sharing the GPU (with and without CUDA graphs), beam-search decoding speed, and the
BERT arms' step time and peak GPU memory against the baseline's.

Every figure is printed as a ``RESULT {json}`` line (and appended to ``--out``), ratios against the baseline or
the bare model measured in the same run. The models are the studies' (``multi30k_small`` preset: 3+3 layers,
d 256, Multi30k En->De, 4,096-token batches); BERT arms read ``minilm`` as their studies do.

  python bench/gpu.py --data-dir ../shared/data [--sections env,contract,sdpa,train,bert,decode,trials,compile,profile,graphs,translate]
                      [--trials 1,4 --trial-graphs] [--out F]
  python bench/gpu.py --device cpu --smoke-test     # every section on the CPU with a few steps (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import MODELS as DECODE_MODELS  # noqa: E402  (bench/: the decode models as studies build them)
from finetune_memory import CASES as FINETUNE_CASES  # noqa: E402
from train_throughput import make_bare_step  # noqa: E402

from nmtcore.bert import ensure_bert  # noqa: E402
from nmtcore.config import DecodeConfig, preset  # noqa: E402
from nmtcore.data import prepare_data  # noqa: E402
from nmtcore.decoding import translate_split  # noqa: E402
from nmtcore.devices import autocast, autocast_dtype  # noqa: E402
from nmtcore.engine import build_trainer  # noqa: E402

ARGS = argparse.Namespace()

# PLM-sponsored as the kd_alpha study trains it, except for its target BERT: minilm (L6/H384, 30k WordPieces)
# in place of the study's e5:L6 (L6/H384, 250k), whose package is too large to carry to a lent GPU machine.
PLM_TGT = {"model.tgt_bert.name": "minilm"} if os.environ.get("NMTCORE_GPU_PLM_TGT") == "minilm" else {}


def result(section: str, **fields) -> None:
    line = json.dumps({"section": section, **fields})
    print("RESULT " + line, flush=True)
    if ARGS.out:
        with open(ARGS.out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def low(precision: str) -> str:
    """``precision``, except bf16 on a CPU without bf16 matmuls (--device cpu checks): fp32 there."""
    return "fp32" if precision == "bf16" and autocast_dtype("auto", ARGS.device) is None else precision


def sync() -> None:
    if ARGS.device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    if ARGS.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if ARGS.device.type == "cuda" else float("nan")


def base_cfg(**over):
    return preset("multi30k_small").with_overrides({
        "data.data_dir": ARGS.data_dir, "data.download": False, "output_dir": "bench/out/gpu", **over})


def model_cfg(**over):
    """``base_cfg`` for ``--graphs-model``'s model (its BERT made ready), with ``over``."""
    if ARGS.graphs_model == "baseline":
        return base_cfg(**over)
    return ensure_bert(base_cfg(**DECODE_MODELS[ARGS.graphs_model], **over))


def take(trainer, n: int) -> list:
    """The first ``n`` training batches, over as many epochs as that needs (each epoch shuffled anew)."""
    out, epoch = [], 1
    while len(out) < n:
        out.extend(b for _, b in zip(range(n - len(out)), trainer.train_batches(epoch=epoch)))
        epoch += 1
    return out


def timed(step, batches: list, warmup: int) -> tuple[float, int]:
    for b in batches[:warmup]:
        step(b)
    sync()
    t0 = time.perf_counter()
    tokens = 0
    for b in batches[warmup:]:
        step(b)
        tokens += b.n_tgt_tokens
    sync()
    return time.perf_counter() - t0, tokens


def profiled(step, batches: list) -> tuple[Any, float, float]:
    """``step`` over ``batches`` under ``torch.profiler`` (the device's kernels too on CUDA): the profile's key
    averages, the wall ms a step and the device's kernel ms a step (0 on a CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ARGS.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        sync()
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ev if e.device_type == DeviceType.CUDA)
    return ev, 1e3 * wall / len(batches), busy / 1e3 / len(batches)


def sec_env() -> None:
    info = {"torch": torch.__version__, "device": str(ARGS.device), "cpus": os.cpu_count()}
    if ARGS.device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    bf16=torch.cuda.is_bf16_supported())
    n = 8192 if ARGS.device.type == "cuda" else 1024
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(n, n, device=ARGS.device, dtype=dtype) for _ in range(2))
        a @ b
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        info[f"matmul_{str(dtype)[6:]}_tflops"] = round(2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12, 1)
    result("env", **info)


def sec_contract() -> None:
    """The contract suite's core checks for every registered model, on the device (tests/test_model_contract.py
    runs them on the CPU): forward shapes, cached decoding = teacher forcing, a bf16 training step, beam search."""
    from nmtcore.decoding.beam_search import beam_search
    from nmtcore.engine.losses import label_smoothed_nll
    from nmtcore.testing.zoo import CASES, PAD, VOCAB, make_batch, tiny_model, with_inputs

    src = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]]
    tgt = [[17, 18, 19], [20, 21, 22, 23, 24], [25]]
    failed = []
    for case in sorted(CASES):
        try:
            model = tiny_model(case).to(ARGS.device)
            batch = with_inputs(model, make_batch(src, tgt)).to(ARGS.device)
            model.eval()
            with torch.no_grad():
                full = model(batch).logits
                assert full.shape == (*batch.tgt_in.shape, VOCAB) and torch.isfinite(full).all(), "forward"
                enc = model.encode(batch)
                state = model.init_state(enc)
                steps = [model.decode_step(batch.tgt_in[:, t: t + 1], enc, state)
                         for t in range(batch.tgt_in.size(1))]
                err = (torch.stack(steps, 1) - full).abs().max().item()
                assert err < 1e-3, f"cached decoding differs from teacher forcing by {err:.2e}"
                hyps = beam_search(model, batch, DecodeConfig(beam=3, max_len_b=6, precision="bf16"))
                assert len(hyps) == 3 and all(h for h in hyps), "beam search"
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            with autocast(torch.bfloat16, ARGS.device):
                logits = model(batch).logits
            loss = label_smoothed_nll(logits.float(), batch.tgt_out, 0.1, PAD).loss
            loss.backward()
            opt.step()
            assert torch.isfinite(loss), "bf16 training step"
        except Exception as e:  # noqa: BLE001 (report every case, then fail the section)
            failed.append(f"{case}: {type(e).__name__}: {e}")
            traceback.print_exc()
    result("contract", cases=len(CASES), failed=failed)


def sec_sdpa() -> None:
    """bf16 training steps with cuDNN in SDPA's backend choice (torch's default) and without (the platform's,
    :func:`nmtcore.devices.shape_free_cuda_attention`), each on batches whose shapes the process has not seen."""
    if ARGS.device.type != "cuda":
        result("sdpa", skipped="CUDA only")
        return
    from nmtcore import devices

    cfg = base_cfg(**{"train.precision": "bf16"})
    trainer = build_trainer(cfg, prepare_data(cfg.data), device=ARGS.device)
    batches = take(trainer, 4 * ARGS.steps)
    devices._CUDNN_SDPA_CHECKED = True
    for cudnn, part in ((True, batches[: ARGS.steps]), (False, batches[2 * ARGS.steps: 3 * ARGS.steps])):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        s, tokens = timed(lambda b: trainer.train_step([b]), part, 0)
        result("sdpa", cudnn_sdpa=cudnn, steps=len(part), tok_s=round(tokens / s),
               step_ms=round(1e3 * s / len(part), 1))
    torch.backends.cuda.enable_cudnn_sdp(False)


def sec_train(runs=(("fp32", False, 1), ("bf16", False, 1), ("fp32", False, 4), ("bf16", False, 4))) -> None:
    data = prepare_data(base_cfg().data)
    vocab = len(data.vocab)
    for precision, compiled, scale in runs:
        precision = low(precision)
        cfg = base_cfg(**{"train.precision": precision, "train.compile": compiled,
                          "data.max_tokens": round(4096 * scale)})
        reset_peak()
        trainer = build_trainer(cfg, data, device=ARGS.device)
        warmup = ARGS.warmup + (10 if compiled else 0)  # compiled: dynamic shapes settle over the first lengths
        batches = take(trainer, warmup + ARGS.steps)
        t_compile = time.perf_counter()
        ours_s, tokens = timed(lambda b: trainer.train_step([b]), batches, warmup)
        ours_peak = peak_gib()
        row = {"precision": precision, "compiled": compiled, "max_tokens": cfg.data.max_tokens, "steps": ARGS.steps,
               "nmtcore_tok_s": round(tokens / ours_s), "nmtcore_step_ms": 1e3 * ours_s / ARGS.steps,
               "nmtcore_peak_gib": round(ours_peak, 2),
               "wall_with_warmup_s": round(time.perf_counter() - t_compile, 1)}
        trainer = None
        if not compiled:
            bare_step = make_bare_step(cfg, vocab, data.vocab.pad_id, precision, ARGS.device)
            reset_peak()
            bare_s, _ = timed(bare_step, batches, ARGS.warmup)
            row.update(bare_tok_s=round(tokens / bare_s), nmtcore_over_bare=round(bare_s / ours_s, 3),
                       bare_peak_gib=round(peak_gib(), 2))
            bare_step = None
        result("compile" if compiled else "train", **row)


def sec_profile() -> None:
    """Where a bf16 training step's time goes, nmtcore's and the bare model's, at the trainer's batches and 4x
    larger ones (torch.profiler over 10 steps): wall time against device-busy time per step, kernel launches and
    host-device waits per step, and the ops that take the most device time and the most host time."""
    cuda = ARGS.device.type == "cuda"
    data = prepare_data(base_cfg().data)
    precision = low("bf16")
    n = 2 if ARGS.smoke_test else 10
    for scale in (1, 4):
        cfg = base_cfg(**{"train.precision": precision, "data.max_tokens": 4096 * scale})
        trainer = build_trainer(cfg, data, device=ARGS.device)
        batches = take(trainer, ARGS.warmup + n)
        steps = {"nmtcore": lambda b: trainer.train_step([b]),
                 "bare": make_bare_step(cfg, len(data.vocab), data.vocab.pad_id, precision, ARGS.device)}
        for who, step in steps.items():
            for b in batches[: ARGS.warmup]:
                step(b)
            sync()
            ev, wall_ms, busy = profiled(step, batches[ARGS.warmup:])
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(f"--- profile {who} max_tokens={cfg.data.max_tokens}: by {key}")
            print(ev.table(sort_by=key, row_limit=25, max_name_column_width=70))
            if cuda:
                print(f"--- profile {who} max_tokens={cfg.data.max_tokens}: by self_cpu_time_total")
                print(ev.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))

            def count(*names):
                return sum(e.count for e in ev if e.key in names) / n

            result("profile", who=who, max_tokens=cfg.data.max_tokens, steps=n,
                   wall_ms_per_step=round(wall_ms, 2), device_busy_ms_per_step=round(busy, 2),
                   launches_per_step=count("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                           "cudaLaunchKernelExC"),
                   waits_per_step=count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
                   copies_per_step=count("cudaMemcpyAsync", "cudaMemcpy"),
                   tok_s=round(sum(b.n_tgt_tokens for b in batches[ARGS.warmup:]) / (wall_ms * n / 1e3)))
        trainer = steps = None


def sec_graphs() -> None:
    """``train.cuda_graphs`` against eager steps, fp32 and bf16, at the trainer's batches and 4x larger ones, for the
    baseline or (``--graphs-model bert_fused``) BERT-fused with drop-net.
    First, with dropout off, the losses of the same five updates from the same initial weights (a graph must
    replay the eager step). Then, as a trial trains: the first epoch (every bucket captured in it; the captures'
    count and cost), tokens/s over ``--steps`` steps after it, peak memory, and over 10 steps under
    ``torch.profiler`` the device's kernel time against the wall time (the busy share of a step)."""
    if ARGS.device.type != "cuda":
        result("graphs", skipped="CUDA only")
        return
    from nmtcore.engine.graphs import pad_to_bucket

    data = prepare_data(base_cfg().data)
    # 0. Which op, if any, makes the host wait inside a forward and backward pass (a capture would fail there).
    trainer = build_trainer(model_cfg(**{"train.precision": "bf16"}), data, device=ARGS.device)
    data = trainer.data  # with the BERT stream (and its cached features) the model reads
    batch = pad_to_bucket(next(iter(trainer.train_batches(epoch=1))).to("cpu"), data.vocab.pad_id).to(ARGS.device)
    sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer._forward_backward(trainer.model, batch, cache=False)
        result("graphs", model=ARGS.graphs_model, check="no host sync in a bf16 forward and backward", ok=True)
    except RuntimeError as e:
        traceback.print_exc()
        result("graphs", model=ARGS.graphs_model, check="no host sync in a bf16 forward and backward", ok=False,
               error=str(e)[:300])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    trainer = None
    # 1. The same updates, eager and graphed, dropout off; with 2 batches an update, gradients accumulate over two
    # replays. Compared: the losses and, after the updates, the weights.
    for precision, freq in (("fp32", 1), ("bf16", 1), ("fp32", 2)):
        losses, weights = {}, {}
        for graphed in (False, True):
            torch.manual_seed(1)
            cfg = model_cfg(**{"train.precision": precision, "train.cuda_graphs": graphed, "model.dropout": 0.0,
                               "model.attention_dropout": 0.0, "model.activation_dropout": 0.0})
            trainer = build_trainer(cfg, data, device=ARGS.device)
            assert (trainer.graphs is not None) == graphed, "train.cuda_graphs did not take effect"
            batches = take(trainer, 5 * freq)
            losses[graphed] = [trainer.train_step(batches[i: i + freq])["loss_sum"]
                               / sum(b.n_tgt_tokens for b in batches[i: i + freq])
                               for i in range(0, len(batches), freq)]
            weights[graphed] = {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()
                                if v.is_floating_point()}
            if graphed:
                st = trainer.graphs.stats
                assert not st.failed and st.eager == 0, st.failed or f"{st.eager} eager batches"
            trainer = None
        diff = max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True]))
        wdiff = max(float((weights[True][k] - w).abs().max()) for k, w in weights[False].items())
        result("graphs", model=ARGS.graphs_model, check="same updates, dropout off", precision=precision,
               batches_per_update=freq,
               eager=losses[False], graphed=losses[True], max_rel_diff=diff, max_abs_weight_diff=wdiff)
    if ARGS.graphs_check_only:
        return
    for precision in ARGS.graphs_precisions.split(","):
        # 2. Speed, as a trial trains (dropout on).
        for scale in (int(x) for x in ARGS.graphs_scales.split(",")):
            row = {"model": ARGS.graphs_model, "precision": precision, "max_tokens": 4096 * scale}
            for graphed in (False, True):
                cfg = model_cfg(**{"train.precision": precision, "train.cuda_graphs": graphed,
                                   "data.max_tokens": 4096 * scale})
                reset_peak()
                trainer = build_trainer(cfg, data, device=ARGS.device)
                sync()
                t0 = time.perf_counter()
                first = sum(trainer.train_step([b])["n_tokens"] for b in trainer.train_batches(epoch=1))
                sync()
                first_s = time.perf_counter() - t0
                batches = take(trainer, ARGS.steps)
                s, tokens = timed(lambda b: trainer.train_step([b]), batches, 0)
                who = "graphs" if graphed else "eager"
                row.update({f"{who}_first_epoch_s": round(first_s, 2), f"{who}_first_epoch_tok_s": round(first / first_s),
                            f"{who}_tok_s": round(tokens / s), f"{who}_step_ms": round(1e3 * s / ARGS.steps, 2),
                            f"{who}_peak_gib": round(peak_gib(), 2)})
                if graphed:
                    st = trainer.graphs.stats
                    row.update(captures=st.captures, capture_s=round(st.capture_s, 2), eager_steps=st.eager,
                               failed=st.failed)
                _, wall_ms, busy = profiled(lambda b: trainer.train_step([b]), batches[:10])
                row.update({f"{who}_profiled_step_ms": round(wall_ms, 2), f"{who}_busy_ms": round(busy, 2),
                            f"{who}_busy_share": round(busy / wall_ms, 3)})
                trainer = None
            row["graphs_over_eager"] = round(row["graphs_tok_s"] / row["eager_tok_s"], 3)
            result("graphs", **row)


def sec_compile() -> None:
    """``train.compile`` (inductor) in bf16 at the batch sizes of ``--compile-max-tokens``."""
    sec_train(tuple(("bf16", True, int(t) / 4096) for t in ARGS.compile_max_tokens.split(",")))


def trial_worker() -> int:
    """One 'trial': train the baseline until told to go, then for ``--seconds``; report target tokens."""
    cfg = model_cfg(**{"train.precision": ARGS.trial_precision or low("bf16"), "train.cuda_graphs": ARGS.graphs})
    trainer = build_trainer(cfg, prepare_data(cfg.data), device=ARGS.device)
    it = trainer.train_batches(epoch=1)
    for _ in range(ARGS.warmup):
        trainer.train_step([next(it)])
    if ARGS.graphs:  # every bucket captured before the clock starts: the rest of epoch 1
        for b in it:
            trainer.train_step([b])
        it = trainer.train_batches(epoch=2)
    sync()
    Path(ARGS.go + f".ready{os.getpid()}").touch()
    while not Path(ARGS.go).exists():
        time.sleep(0.05)
    tokens = steps = 0
    epoch = 1
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < ARGS.seconds:
        b = next(it, None)
        if b is None:  # the epoch is over: the next one, shuffled anew
            epoch += 1
            it = trainer.train_batches(epoch=epoch)
            continue
        trainer.train_step([b])
        tokens += b.n_tgt_tokens
        steps += 1
    sync()
    wall = time.perf_counter() - t0
    print("WORKER " + json.dumps({"tokens": tokens, "steps": steps, "wall_s": wall, "peak_gib": peak_gib()}),
          flush=True)
    return 0


def sec_trials() -> None:
    """K trials (processes) training the baseline at once on the device, as a sweep with
    ``--gpus-per-trial 1/K`` runs them: the sum of their tokens/s against one alone."""
    for graphs in sorted({ARGS.graphs, ARGS.trial_graphs}):
        _trials(graphs)


def _trials(graphs: bool) -> None:
    alone = None
    for k in ARGS.trials:
        go = Path(ARGS.scratch) / f"go{k}{'g' if graphs else ''}"
        go.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", "--device", str(ARGS.device), "--data-dir", ARGS.data_dir,
               "--seconds", str(ARGS.seconds), "--go", str(go), "--warmup", str(ARGS.warmup),
               *(["--graphs"] if graphs else []), "--graphs-model", ARGS.graphs_model,
               *(["--trial-precision", ARGS.trial_precision] if ARGS.trial_precision else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // k))}
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(k)]
        t0 = time.perf_counter()
        while len(list(go.parent.glob(go.name + ".ready*"))) < k:
            if any(p.poll() is not None for p in procs) or time.perf_counter() - t0 > 300:
                break
            time.sleep(0.1)
        go.touch()
        outs = [p.communicate()[0] for p in procs]
        rows = [json.loads(line[7:]) for out in outs for line in out.splitlines() if line.startswith("WORKER ")]
        if len(rows) != k:
            result("trials", k=k, cuda_graphs=graphs, error=f"{len(rows)} of {k} workers reported",
                   rcs=[p.returncode for p in procs])
            continue
        total = sum(r["tokens"] / r["wall_s"] for r in rows)
        alone = alone or total
        result("trials", model=ARGS.graphs_model, k=k, cuda_graphs=graphs, precision=ARGS.trial_precision or low("bf16"),
               total_tok_s=round(total), per_trial_tok_s=round(total / k),
               total_over_one=round(total / alone, 2), peak_gib_per_trial=round(max(r["peak_gib"] for r in rows), 2))


def sec_decode() -> None:
    data = prepare_data(base_cfg().data)
    split = data.splits["test_2016_flickr"]
    n = min(ARGS.sentences, len(split.src))
    length = int(round(float(np.mean([len(t) for t in split.tgt[:n]])))) + 1
    speeds = {}
    for name in ("baseline", "bert_fused", "plm_sponsored"):
        cfg = ensure_bert(base_cfg(**DECODE_MODELS[name], **(PLM_TGT if name == "plm_sponsored" else {})))
        trainer = build_trainer(cfg, prepare_data(cfg.data), device=ARGS.device)
        sp = trainer.data.splits["test_2016_flickr"].select(range(n))
        for beam, max_sentences in ((5, 128), (5, 0), (1, 0)):  # 0: the default by device
            dcfg = DecodeConfig(beam=beam, max_len_a=0.0, max_len_b=length, min_len=length,
                                max_sentences=max_sentences)
            translate_split(trainer.model, sp.select(range(64)), trainer.data.vocab, dcfg, ARGS.device)
            sync()
            reset_peak()
            t0 = time.perf_counter()
            hyps = translate_split(trainer.model, sp, trainer.data.vocab, dcfg, ARGS.device)
            sync()
            sps = len(hyps) / (time.perf_counter() - t0)
            speeds[name, beam, max_sentences] = sps
            base = speeds.get(("baseline", beam, max_sentences), sps)
            result("decode", model=name, beam=beam, max_sentences=dcfg.sentences_per_batch(ARGS.device),
                   length=length, sentences=len(hyps), sent_per_s=round(sps, 1), vs_baseline=round(sps / base, 2),
                   peak_gib=round(peak_gib(), 2))
        trainer = None


def sec_translate() -> None:
    """A model that translates: the baseline (or ``--graphs-model``) trained on the device for ``--translate-epochs`` epochs (bf16 where
    the device has it, the preset's schedule otherwise), then test_2016_flickr decoded with the studies' decode
    settings, beam 5 and greedy: BLEU and sentences/s (the decode section times untrained weights at a fixed
    output length; this one the lengths a trained model chooses). With ``--trial-graphs``, once eagerly and once
    with ``train.cuda_graphs``."""
    for graphs in sorted({ARGS.graphs, ARGS.trial_graphs}):
        _translate(graphs)


def _translate(graphs: bool) -> None:
    from nmtcore.bleu import corpus_bleu

    precision = low("bf16")
    cfg = model_cfg(**{"train.precision": precision, "train.max_epochs": ARGS.translate_epochs, "train.patience": 0,
                       "train.cuda_graphs": graphs,
                       "output_dir": str(Path(ARGS.scratch) / f"translate{'-graphs' if graphs else ''}")})
    trainer = build_trainer(cfg, prepare_data(cfg.data), device=ARGS.device)
    fit = trainer.fit()
    last = trainer.state.history[-1]
    stats = trainer.graphs.stats if trainer.graphs is not None else None
    result("translate", stage="train", model=ARGS.graphs_model, cuda_graphs=graphs, precision=precision,
           epochs=fit.epochs,
           graph_captures=stats and stats.captures, graph_replays=stats and stats.replays,
           eager_steps=stats and stats.eager, updates=fit.num_updates,
           fit_wall_s=round(fit.fit_wall_s, 1), train_tok_s=round(last["train_tokens_per_s"]),
           valid_loss=round(last["valid_loss"], 3), valid_greedy_bleu=round(last.get("valid_bleu", float("nan")), 2))
    split = trainer.data.splits["test_2016_flickr"]
    for beam in (5, 1):
        dcfg = DecodeConfig(**{**cfg.decode.__dict__, "beam": beam})
        trainer.translate(split.select(range(64)), dcfg)  # warm-up, not timed
        sync()
        reset_peak()
        t0 = time.perf_counter()
        hyps = trainer.translate(split, dcfg)
        sync()
        s = time.perf_counter() - t0
        result("translate", stage="decode", cuda_graphs=graphs, beam=beam, lenpen=dcfg.lenpen, max_len=f"{dcfg.max_len_a}x+{dcfg.max_len_b}",
               max_sentences=dcfg.sentences_per_batch(ARGS.device), sentences=len(hyps),
               sent_per_s=round(len(hyps) / s, 1), bleu=round(corpus_bleu(hyps, split.raw_tgt).score, 2),
               mean_hyp_words=round(float(np.mean([len(h.split()) for h in hyps])), 1), peak_gib=round(peak_gib(), 2))


def sec_bert() -> None:
    """Training step time and peak GPU memory of the BERT arms (as their studies train them) against the baseline."""
    plm = {**FINETUNE_CASES["plm_sponsored"], **PLM_TGT}
    arms = {"baseline": {}, "bert_fused": DECODE_MODELS["bert_fused"], "bert_jam": DECODE_MODELS["bert_jam"],
            "bert_jam_finetune": FINETUNE_CASES["bert_jam_ft"], "plm_sponsored": plm,
            "plm_sponsored_ckpt": {**plm, "model.bert.activation_checkpointing": True,
                                   "model.tgt_bert.activation_checkpointing": True}}
    for precision in ARGS.bert_precisions.split(","):
        precision, base = low(precision), None
        for name, over in arms.items():
            cfg = ensure_bert(base_cfg(**{"train.precision": precision, **over}))
            reset_peak()
            trainer = build_trainer(cfg, prepare_data(cfg.data), device=ARGS.device)
            batches = take(trainer, ARGS.warmup + ARGS.steps)
            s, tokens = timed(lambda b: trainer.train_step([b]), batches, ARGS.warmup)
            row = {"tok_s": round(tokens / s), "step_ms": round(1e3 * s / ARGS.steps, 2),
                   "peak_gib": round(peak_gib(), 3)}
            base = base or row
            result("bert", arm=name, precision=precision,
                   **({"tgt_bert": "minilm"} if PLM_TGT and name.startswith("plm") else {}), **row,
                   time_vs_baseline=round(base["tok_s"] / row["tok_s"], 2),
                   memory_vs_baseline=round(row["peak_gib"] / base["peak_gib"], 2) if base["peak_gib"] else None)
            trainer = None


SECTIONS = {"env": sec_env, "contract": sec_contract, "sdpa": sec_sdpa, "train": sec_train, "bert": sec_bert,
            "decode": sec_decode, "trials": sec_trials, "compile": sec_compile, "profile": sec_profile,
            "graphs": sec_graphs,
            "translate": sec_translate}


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", default="1,2,4,8", help="trial counts sharing the device")
    p.add_argument("--seconds", type=float, default=15.0, help="each trial's timed training (trials section)")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--bert-precisions", default="bf16", help="precisions of the bert section (e.g. fp32,bf16)")
    p.add_argument("--compile-max-tokens", default="4096,16384", help="batch sizes of the compile section")
    p.add_argument("--translate-epochs", type=int, default=30, help="the translate section's training")
    p.add_argument("--graphs", action="store_true", help="train.cuda_graphs in the trials section's trials")
    p.add_argument("--graphs-check-only", action="store_true", help="the graphs section's checks, not its timings")
    p.add_argument("--graphs-model", default="baseline", choices=["baseline", "bert_fused"],
                   help="the model of the graphs, translate and trials sections (bert_fused: drop-net planned on the host)")
    p.add_argument("--graphs-precisions", default="fp32,bf16", help="the graphs section's timed precisions")
    p.add_argument("--graphs-scales", default="1,4", help="its batch sizes, in multiples of 4096 tokens")
    p.add_argument("--trial-graphs", action="store_true",
                   help="the trials and translate sections both without and with graphs")
    p.add_argument("--trial-precision", default="", help="the trials' precision (default: bf16 where there is one)")
    p.add_argument("--out", default="")
    p.add_argument("--scratch", default="bench/out/gpu")
    p.add_argument("--smoke-test", action="store_true", help="a few steps of every section")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    ARGS = p.parse_args()
    ARGS.device = torch.device(ARGS.device)
    ARGS.trials = [int(k) for k in str(ARGS.trials).split(",")]
    if ARGS.smoke_test:
        ARGS.steps, ARGS.warmup, ARGS.seconds, ARGS.sentences, ARGS.trials = 2, 1, 1.0, 70, [1, 2]
        ARGS.translate_epochs = 1
    if ARGS.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --smoke-test to check the script)")
    if ARGS.worker:
        return trial_worker()
    Path(ARGS.scratch).mkdir(parents=True, exist_ok=True)
    bad = 0
    for name in ARGS.sections.split(","):
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
        except Exception as e:  # noqa: BLE001 (one broken section must not cost the others' figures)
            traceback.print_exc()
            result(name, error=f"{type(e).__name__}: {e}")
            bad += 1
        print(f"section {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
