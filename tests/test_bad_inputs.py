"""Bad input never ends in a traceback, a hang or half-written files (issue 7, items 5 and 6).

One table per command (train, translate, evaluate). Every case runs the CLI in process
(``nmtcore.cli.main``) and checks the whole contract: exit status 2; one error line on stderr,
``nmtcore: error: `` and a message naming the culprit (file, config key, model, URI), with nothing else
there but log records; no file written anywhere under the case's directory (no checkpoint, no partial
output, no probe) or into the data cache; and no MLflow run left RUNNING (a run that started ends FAILED
with the same reason). Two cases run as a real process, as a user sees them.

Then tracking (unwritable store, unreachable server: fast), a search space naming a missing key (caught
by the sweep entry point before Ray), and the security defaults: a checkpoint holding pickled code is
refused on every path that loads one, and the Ray dashboard and the MLflow UI bind to 127.0.0.1 unless
asked otherwise. No Ray cluster starts.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from nmtcore import tracking
from nmtcore.checkpoint import save_checkpoint
from nmtcore.cli import main
from nmtcore.config import ExperimentConfig
from nmtcore.data import SubwordVocab, prepare_data
from nmtcore.files import sha256_file
from nmtcore.models import build_model
from nmtcore.testing.synthetic import tiny_experiment
from search_spaces import SearchSpace, grid

REPO = Path(__file__).resolve().parents[1]
PREFIX = "nmtcore: error: "
# A logging record as the CLI (2026-01-02 03:04:05,678 INFO ...) or MLflow (2026/01/02 03:04:05 INFO ...) prints it.
LOG_RECORD = re.compile(r"\d{4}[-/]\d\d[-/]\d\d \d\d:\d\d:\d\d\S* (DEBUG|INFO|WARNING) ")
UNWRITABLE = Path("/proc/nmtcore-unwritable")  # even root cannot create anything under /proc


# ---------------------------------------------------------------------------------------------- fixtures
@dataclasses.dataclass
class World:
    """What every case shares: the tiny synthetic experiment as a YAML file, its (cached) vocabulary, a
    second vocabulary for mismatches, and one sqlite tracking store."""

    root: Path
    cfg: ExperimentConfig
    config: Path
    vocab: SubwordVocab
    other_vocab: SubwordVocab
    uri: str

    @property
    def data(self) -> Path:
        return Path(self.cfg.data.data_dir)

    @property
    def cache(self) -> Path:
        return Path(self.cfg.data.cache_dir)

    def runs(self, experiment: str) -> list[tracking.RunRecord]:
        return tracking.load_runs(experiment=experiment, tracking_uri=self.uri)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("bad-inputs")
    cfg = tiny_experiment(root, **{"train.max_epochs": 1, "train.num_threads": 1})
    config = root / "tiny.yaml"
    config.write_text(cfg.to_yaml(), encoding="utf-8")
    vocab = prepare_data(cfg.data).vocab  # cached: the CLI runs below reuse it
    other = prepare_data(dataclasses.replace(cfg.data, vocab_size=80)).vocab
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with tracking.Tracker(uri, experiment="store-setup"):  # creating the schema takes seconds: once, here
        pass
    return World(root, cfg, config, vocab, other, uri)


@dataclasses.dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """``cli("train", ...)`` runs ``nmtcore train ...`` in this process, offline."""
    monkeypatch.setenv("NMTCORE_OFFLINE", "1")
    # Not HF_HUB_OFFLINE: huggingface_hub reads it once, at import, and would stay offline for every
    # later test of the session (the hub-download test of tests/test_bert.py).
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own handler: give pytest's back

    def run(*argv: Any) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        finally:
            signal.signal(signal.SIGTERM, sigterm)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def one_line_error(r: Result, *culprits: str) -> str:
    """The error line, after checking exit status 2, that stderr ends with it and holds nothing else but
    log records (a training run logs its progress at INFO; no traceback, no stray output), and that it
    names every culprit."""
    assert r.code == 2, r.err[-3000:]
    lines = r.err.splitlines()
    assert lines and [line for line in lines if not LOG_RECORD.match(line)] == lines[-1:], r.err[-3000:]
    line = lines[-1]
    assert line.startswith(PREFIX), r.err[-3000:]
    for culprit in culprits:
        assert culprit in line, f"{culprit!r} not in {line!r}"
    print(line)  # shown by `pytest -rP`: the lines users see
    return line


def files_under(*dirs: Path) -> set[Path]:
    return {p for d in dirs if d.exists() for p in d.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------ bad inputs
def corpus_copy(w: World, tmp: Path, edit: Callable[[Path], None]) -> Path:
    """A copy of the synthetic corpus with one fault, under ``tmp/data``."""
    d = tmp / "data"
    d.mkdir()
    for f in w.data.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    edit(d)
    return d


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def drop_last_line(path: Path) -> None:
    path.write_text("".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[:-1]), encoding="utf-8")


def bad_byte_on_line_5(path: Path) -> None:
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4] + b" caf\xe9"  # Latin-1 é
    path.write_bytes(b"\n".join(lines))


def model_checkpoint(path: Path, cfg: ExperimentConfig, vocab: SubwordVocab, weights_vocab: int | None = None,
                     weights_cfg: ExperimentConfig | None = None, model: Any = None) -> Path:
    """A checkpoint as the trainer writes it (model, config, vocabulary), optionally with weights built
    for another vocabulary size or config (a mismatch) or with an arbitrary ``model`` entry."""
    if model is None:
        wc = (weights_cfg or cfg).model
        net = build_model(wc, weights_vocab or len(vocab), vocab.pad_id, vocab.bos_id, vocab.eos_id)
        model = net.state_dict()
    return save_checkpoint(path, {"model": model, "config": cfg.to_dict(), "vocab": vocab.to_tensor_payload()})


def truncated(path: Path, fresh_sidecar: bool = False) -> Path:
    """Cut ``path`` to half its bytes; with ``fresh_sidecar`` its checksum file is rewritten to match (a
    copy that lost its tail before someone ran sha256sum), so only the load itself can catch it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    if fresh_sidecar:
        path.with_name(path.name + ".sha256").write_text(f"{sha256_file(path)}  {path.name}\n")
    return path


class Code:
    """Unpickling this creates ``marker``: proves whether a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def pickled_code(w: World, tmp: Path) -> Path:
    return model_checkpoint(tmp / "evil.pt", w.cfg, w.vocab, model=Code(tmp / "code-ran"))


def good(w: World, tmp: Path) -> Path:
    return model_checkpoint(tmp / "good.pt", w.cfg, w.vocab)


def wider(w: World) -> ExperimentConfig:
    return w.cfg.with_overrides({"model.d_model": 128, "model.ffn_dim": 128})


# Each case: id, args after ``train`` (built from the shared world and the case's own directory; the case
# runs with --output-dir <case dir>/run, which args may replace), what the error line must name, and
# whether the MLflow run has started when the error comes (it must then end FAILED, else not exist).
Args = Callable[[World, Path], list]
TRAIN_CASES: list[tuple[str, Args, Callable[[World, Path], list[str]], bool]] = [
    # configuration: caught before the MLflow run starts
    ("config-file-missing", lambda w, t: ["--config", t / "absent.yaml"],
     lambda w, t: [f"{t / 'absent.yaml'}: no such file"], False),
    ("config-key-twice", lambda w, t: ["--config", write(t / "twice.yaml", b"train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")],
     lambda w, t: [f"{t / 'twice.yaml'}: line 3, column 3: key 'lr' given twice"], False),
    ("config-empty", lambda w, t: ["--config", write(t / "empty.yaml", b"# nothing here\n")],
     lambda w, t: [f"{t / 'empty.yaml'}: empty (no data/model/train/decode sections)"], False),
    ("config-a-directory", lambda w, t: ["--config", t], lambda w, t: [f"{t}: is a directory, not a YAML file"], False),
    ("config-not-yaml", lambda w, t: ["--config", write(t / "bad.yaml", b"model:\n  d_model: [64\n")],
     lambda w, t: [f"{t / 'bad.yaml'}: line 3, column 1: not valid YAML"], False),
    ("config-not-a-mapping", lambda w, t: ["--config", write(t / "list.yaml", b"- 1\n- 2\n")],
     lambda w, t: [f"{t / 'list.yaml'}: top level must be a mapping"], False),
    ("unknown-key", lambda w, t: ["--set", "train.lrr=1"], lambda w, t: ["train.lrr: unknown key"], False),
    ("unknown-model", lambda w, t: ["--set", "model.name=bert_fusd"],
     lambda w, t: ["model.name: unknown model 'bert_fusd' (registered: "], False),
    ("dropout-range", lambda w, t: ["--set", "model.dropout=2"],
     lambda w, t: ["model.dropout: must be in [0, 1], got 2.0"], False),
    ("theta-range", lambda w, t: ["--set", "model.name=mask_fusion", "model.bert.name=minilm",
                                  "model.mask_threshold=1.5"],
     lambda w, t: ["model.mask_threshold: must be in [0, 1], got 1.5"], False),
    ("p-net-range", lambda w, t: ["--set", "model.name=bert_fused", "model.p_net=-0.1"],
     lambda w, t: ["model.p_net: must be in [0, 1], got -0.1"], False),
    ("alpha-range", lambda w, t: ["--set", "train.kd_alpha=1.5"],
     lambda w, t: ["train.kd_alpha: must be in [0, 1], got 1.5"], False),
    ("heads-divide-d-model", lambda w, t: ["--set", "model.heads=3"],
     lambda w, t: ["model.heads: must divide model.d_model (64 % 3 != 0)"], False),
    # where the run writes: probed before the MLflow run starts, nothing left behind by the probe
    ("output-dir-in-proc", lambda w, t: ["--output-dir", UNWRITABLE / "out"],
     lambda w, t: [f"output_dir: directory {UNWRITABLE / 'out'} is not writable"], False),
    ("output-dir-under-a-file", lambda w, t: ["--output-dir", write(t / "file", b"x") / "out"],
     lambda w, t: [f"output_dir: cannot create directory {t / 'file' / 'out'}: {t / 'file'} is not a directory"],
     False),
    ("save-dir-in-proc", lambda w, t: ["--set", f"train.save_dir={UNWRITABLE / 'ckpt'}"],
     lambda w, t: [f"train.save_dir: directory {UNWRITABLE / 'ckpt'} is not writable"], False),
    # data: every split is read and checked before anything is written
    ("missing-data-dir", lambda w, t: ["--data-dir", "/nonexistent"],
     lambda w, t: ["missing files (looked for /nonexistent/train.xx"], True),
    ("missing-multi30k", lambda w, t: ["--preset", "multi30k_small", "--data-dir", "/nonexistent",
                                       "--set", "data.download=false", f"data.cache_dir={t / 'cache'}"],
     lambda w, t: ["/nonexistent/multi30k"], True),
    ("line-counts-differ", lambda w, t: ["--data-dir", corpus_copy(w, t, lambda d: drop_last_line(d / "valid.yy"))],
     lambda w, t: [f"line counts differ: {t / 'data' / 'valid.xx'} has 200 lines, {t / 'data' / 'valid.yy'} has 199"],
     True),
    ("empty-corpus-file", lambda w, t: ["--data-dir", corpus_copy(w, t, lambda d: (d / "train.yy").write_text(""))],
     lambda w, t: [f"{t / 'data' / 'train.yy'} is empty"], True),
    ("non-utf8-corpus", lambda w, t: ["--data-dir", corpus_copy(w, t, lambda d: bad_byte_on_line_5(d / "train.xx"))],
     lambda w, t: [f"{t / 'data' / 'train.xx'}: line 5 is not valid UTF-8 (byte 0xe9)"], True),
    # a BERT nothing offline answers
    ("bert-offline", lambda w, t: ["--set", "model.name=bert_fused", "model.bert.name=org/absent-bert"],
     lambda w, t: ["BERT org/absent-bert not found; tried: ", "NMTCORE_OFFLINE"], True),
    # warm start (train.init_from): refused before the first update
    ("init-from-missing", lambda w, t: ["--set", f"train.init_from={t / 'absent.pt'}"],
     lambda w, t: [f"{t / 'absent.pt'}: checkpoint not found"], True),
    ("init-from-truncated", lambda w, t: ["--set", f"train.init_from={truncated(good(w, t))}"],
     lambda w, t: [f"{t / 'good.pt'}: checksum mismatch"], True),
    ("init-from-truncated-fresh-sidecar",
     lambda w, t: ["--set", f"train.init_from={truncated(good(w, t), fresh_sidecar=True)}"],
     lambda w, t: [f"{t / 'good.pt'}: not a readable checkpoint", "failed finding central directory"], True),
    ("init-from-other-vocabulary",
     lambda w, t: ["--set", f"train.init_from={model_checkpoint(t / 'v.pt', w.cfg, w.other_vocab)}"],
     lambda w, t: [f"{t / 'v.pt'}: vocabulary {w.other_vocab.checksum[:12]} differs from this run's "
                   f"{w.vocab.checksum[:12]}"], True),
    ("init-from-other-dimensions",
     lambda w, t: ["--set", f"train.init_from={model_checkpoint(t / 'd.pt', wider(w), w.vocab)}"],
     lambda w, t: [f"{t / 'd.pt'}: model.d_model is 128 in the checkpoint but 64 here"], True),
    ("init-from-pickled-code", lambda w, t: ["--set", f"train.init_from={pickled_code(w, t)}"],
     lambda w, t: [f"{t / 'evil.pt'}: cannot load safely", "Unsupported global: GLOBAL io.open"], True),
]


@pytest.mark.parametrize("args, culprits, starts_run", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(args: Args, culprits: Callable, starts_run: bool, world: World, cli, tmp_path: Path,
                         request: pytest.FixtureRequest) -> None:
    experiment = request.node.callspec.id
    case_args = args(world, tmp_path)
    base = [] if "--preset" in case_args else ["--config", world.config]
    argv = ["train", *base, "--tracking-uri", world.uri, "--experiment", experiment,
            "--output-dir", tmp_path / "run", *case_args]
    before, cache = files_under(tmp_path), files_under(world.cache)
    line = one_line_error(cli(*argv), *culprits(world, tmp_path))
    assert files_under(tmp_path) == before  # no checkpoint, no hypotheses, no probe or temp file
    assert files_under(world.cache) == cache
    assert not (tmp_path / "code-ran").exists()
    runs = world.runs(experiment)
    if starts_run:
        assert [r.status for r in runs] == ["FAILED"]
        reason = runs[0].tags[tracking.FAILURE_REASON_TAG].partition(": ")[2]  # "DataError: <message>"
        assert line.removeprefix(PREFIX).startswith(reason.removesuffix("...[truncated]"))
    else:
        assert runs == []


def test_a_diverging_run_ends_with_one_line_and_a_failed_run(world: World, cli, tmp_path: Path) -> None:
    """Issue 53: a learning rate that blows the loss up ended in an OverflowError traceback (the validation
    perplexity) or a 20-line NonFiniteLossError one. Now: exit 1, one line saying where, which figure and what
    to try, the MLflow run FAILED with that line as its reason."""
    r = cli("train", "--config", world.config, "--tracking-uri", world.uri, "--experiment", "diverges",
            "--output-dir", tmp_path / "run", "--set", "train.lr=50", "--set", "train.warmup_updates=1")
    # (--set given twice: both count; the second replaced the first before)
    assert r.code == 1, r.err[-3000:]
    lines = [line for line in r.err.splitlines() if not LOG_RECORD.match(line)]
    assert len(lines) == 1 and re.fullmatch(
        PREFIX + r"training diverged at update \d+ \(epoch 1\): the training loss \S+ bits/token: its perplexity "
        r"overflows; no checkpoint had been written; try a lower train.lr \(now 50\), a longer "
        r"train.warmup_updates \(now 1\) or train.clip_norm \(now 0\)", lines[0]), r.err[-3000:]
    [run] = world.runs("diverges")
    assert run.status == "FAILED"
    assert run.tags[tracking.FAILURE_REASON_TAG] == "NonFiniteLossError: " + lines[0].removeprefix(PREFIX)


TRANSLATE_CASES: list[tuple[str, Args, Callable[[World, Path], list[str]]]] = [
    ("checkpoint-without-config", lambda w, t: ["--checkpoint", save_checkpoint(t / "bare.pt", {"weights": {}})],
     lambda w, t: [f"{t / 'bare.pt'}: not a model checkpoint of this project (no config, vocab, model)"]),
    ("checkpoint-config-unknown-key", lambda w, t: ["--checkpoint", save_checkpoint(
        t / "newer.pt", {"model": {}, "vocab": w.vocab.to_tensor_payload(),
                         "config": {**w.cfg.to_dict(), "train": {**w.cfg.to_dict()["train"], "future_knob": 1}}})],
     lambda w, t: [f"{t / 'newer.pt'}: its config does not load here", "future_knob"]),
    ("checkpoint-missing", lambda w, t: ["--checkpoint", "/nonexistent.pt"],
     lambda w, t: ["/nonexistent.pt: checkpoint not found"]),
    ("checkpoint-truncated", lambda w, t: ["--checkpoint", truncated(good(w, t))],
     lambda w, t: [f"{t / 'good.pt'}: checksum mismatch"]),
    ("checkpoint-truncated-fresh-sidecar", lambda w, t: ["--checkpoint", truncated(good(w, t), fresh_sidecar=True)],
     lambda w, t: [f"{t / 'good.pt'}: not a readable checkpoint", "failed finding central directory"]),
    ("checkpoint-other-vocabulary",
     lambda w, t: ["--checkpoint", model_checkpoint(t / "v.pt", w.cfg, w.vocab, weights_vocab=len(w.other_vocab))],
     lambda w, t: [f"{t / 'v.pt'}: ", f"has shape ({len(w.other_vocab)}, 64), model expects ({len(w.vocab)}, 64)"]),
    ("checkpoint-other-dimensions",
     lambda w, t: ["--checkpoint", model_checkpoint(t / "d.pt", w.cfg, w.vocab, weights_cfg=wider(w))],
     lambda w, t: [f"{t / 'd.pt'}: ", "model expects", "(different vocabulary or dimensions?)"]),
    ("checkpoint-pickled-code", lambda w, t: ["--checkpoint", pickled_code(w, t)],
     lambda w, t: [f"{t / 'evil.pt'}: cannot load safely", "Unsupported global: GLOBAL io.open"]),
    ("input-non-utf8", lambda w, t: ["--checkpoint", good(w, t), "--input", write(t / "bad.txt", b"ka lo\nmi \xff\n")],
     lambda w, t: [f"{t / 'bad.txt'}: line 2 is not valid UTF-8 (byte 0xff)"]),
    ("input-missing", lambda w, t: ["--checkpoint", good(w, t), "--input", t / "absent.txt"],
     lambda w, t: [f"cannot read {t / 'absent.txt'}"]),
    ("output-in-proc", lambda w, t: ["--checkpoint", good(w, t), "--output", UNWRITABLE / "hyps.txt"],
     lambda w, t: [f"--output: directory {UNWRITABLE} is not writable"]),
    ("output-under-a-file", lambda w, t: ["--checkpoint", good(w, t), "--output", t / "in.txt" / "hyps.txt"],
     lambda w, t: [f"--output: {t / 'in.txt'} is not a directory"]),
]


@pytest.mark.parametrize("args, culprits", [c[1:] for c in TRANSLATE_CASES], ids=[c[0] for c in TRANSLATE_CASES])
def test_translate_bad_input(args: Args, culprits: Callable, world: World, cli, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("ka lo mi\npe ra\n", encoding="utf-8")
    argv = ["translate", "--input", tmp_path / "in.txt", "--output", tmp_path / "hyps.txt", *args(world, tmp_path)]
    before = files_under(tmp_path)
    one_line_error(cli(*argv), *culprits(world, tmp_path))
    assert files_under(tmp_path) == before  # in particular no hyps.txt, not even an empty one
    assert not (tmp_path / "code-ran").exists()


def test_translate_writes_the_whole_output_file(world: World, cli, tmp_path: Path) -> None:
    """The control for the table above: the same call with nothing wrong succeeds."""
    (tmp_path / "in.txt").write_text("ka lo mi\npe ra\n", encoding="utf-8")
    r = cli("translate", "--checkpoint", good(world, tmp_path), "--input", tmp_path / "in.txt",
            "--output", tmp_path / "out" / "hyps.txt", "--set", "decode.beam=1")
    assert r.code == 0 and r.err == "", r.err[-3000:]
    assert len((tmp_path / "out" / "hyps.txt").read_text(encoding="utf-8").splitlines()) == 2
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["hyps.txt"]  # no temp file left


EVALUATE_CASES: list[tuple[str, Args, Callable[[World, Path], list[str]]]] = [
    ("line-counts-differ", lambda w, t: ["--hyp", write(t / "hyp", b"a b\n"), "--ref", t / "ref"],
     lambda w, t: [f"1 hypotheses in {t / 'hyp'} but 2 references in {t / 'ref'}"]),
    ("non-utf8-hypotheses", lambda w, t: ["--hyp", write(t / "hyp", b"a b\nc \xff\n"), "--ref", t / "ref"],
     lambda w, t: [f"{t / 'hyp'}: line 2 is not valid UTF-8 (byte 0xff)"]),
    ("references-missing", lambda w, t: ["--hyp", t / "ref", "--ref", t / "absent"],
     lambda w, t: [f"cannot read {t / 'absent'}"]),
]


@pytest.mark.parametrize("args, culprits", [c[1:] for c in EVALUATE_CASES], ids=[c[0] for c in EVALUATE_CASES])
def test_evaluate_bad_input(args: Args, culprits: Callable, world: World, cli, tmp_path: Path) -> None:
    (tmp_path / "ref").write_text("a b\nc d\n", encoding="utf-8")
    r = cli("evaluate", *args(world, tmp_path))
    one_line_error(r, *culprits(world, tmp_path))
    assert r.out == ""


# ---------------------------------------------------------------------------------------------- tracking
@pytest.mark.parametrize("store", ["proc", "under-a-file"])
def test_unwritable_tracking_store(store: str, world: World, cli, tmp_path: Path) -> None:
    db_dir = UNWRITABLE if store == "proc" else tmp_path / "file"
    if store == "under-a-file":
        db_dir.write_text("x")
    uri = f"sqlite:///{db_dir / 'mlflow.db'}"
    before = files_under(tmp_path)
    one_line_error(cli("train", "--config", world.config, "--output-dir", tmp_path / "run", "--tracking-uri", uri),
                   f"cannot create tracking store directory {db_dir} ({uri}): "
                   + ("No such file or directory" if store == "proc" else "a file is in the way"))
    assert files_under(tmp_path) == before


def test_unreachable_tracking_server_fails_fast(world: World, cli, tmp_path: Path) -> None:
    """Before any data is read or an epoch is trained, in seconds: no retries with back-off (MLflow's
    defaults would wait minutes)."""
    t0 = time.perf_counter()
    r = cli("train", "--config", world.config, "--output-dir", tmp_path / "run", "--tracking-uri", "http://127.0.0.1:9")
    elapsed = time.perf_counter() - t0
    one_line_error(r, "cannot start MLflow run at http://127.0.0.1:9")
    assert elapsed < 15, f"took {elapsed:.1f} s"  # MLflow's own retries would take over 2 minutes
    assert files_under(tmp_path) == set()


def nmtcore(*argv: Any) -> Result:
    """``nmtcore ...`` as a separate process, as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "nmtcore.cli", *map(str, argv)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    return Result(r.returncode, r.stdout, r.stderr)


def test_a_real_process_prints_the_error_line_alone(tmp_path: Path) -> None:
    """As a user sees it: a separate process, logging configured by the CLI, and stderr is the line alone."""
    r = nmtcore("train", "--no-track", "--set", "train.lrr=1", "--output-dir", tmp_path / "run")
    assert one_line_error(r, "train.lrr: unknown key") == r.err.rstrip("\n")
    assert files_under(tmp_path) == set()


@pytest.mark.slow  # a fresh interpreter importing torch and MLflow, then the sqlite store: 5-10 s
def test_a_real_process_after_the_mlflow_run_started(world: World, tmp_path: Path) -> None:
    """A data error after the tracker started (and ended the run FAILED): stderr holds log records at
    most, then the line; no traceback."""
    data = corpus_copy(world, tmp_path, lambda d: drop_last_line(d / "test.xx"))
    r = nmtcore("train", "--config", world.config, "--data-dir", data, "--output-dir", tmp_path / "run",
                "--tracking-uri", world.uri, "--experiment", "subprocess")
    one_line_error(r, "line counts differ: ", str(data / "test.xx"))
    assert [run.status for run in world.runs("subprocess")] == ["FAILED"]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ sweeps
def sweep_args(world: World, tmp_path: Path, variant: str) -> Any:
    from nmtcore.cli import sweep as cli

    return cli.build_parser("test", "transformer_grid", ["demo", variant], variant).parse_args(
        ["--variant", variant, "--config", str(world.config), "--storage", str(tmp_path / "ray"),
         "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--set", f"data.data_dir={world.data}", "train.valid_bleu=true"])


def test_sweep_space_with_a_missing_key_fails_before_ray(world: World, tmp_path: Path, capsys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the entry point's own error handling: one line naming the space and the key, exit 2,
    Ray never started, no Ray results folder and no MLflow store created."""
    from types import SimpleNamespace as Study

    from nmtcore.cli import sweep as cli
    from nmtcore.sweep import ray_backend

    space = SearchSpace("transformer_grid", "typo", "transformer", params={"model.d_modle": grid((128, 256))})
    study = Study(STUDY="transformer_grid", SPACES={"typo": space}, DEFAULT="typo")
    monkeypatch.setattr(ray_backend, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.setattr(sys, "argv", ["sweeps/sweep.py"])
    code = cli.main(study, sweep_args(world, tmp_path, "typo"))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err == "sweep.py: error: transformer_grid:typo: model.d_modle: unknown key\n"
    assert files_under(tmp_path) == set()


# ---------------------------------------------------------------------------------- security defaults
def test_every_torch_load_is_weights_only() -> None:
    """No module loads a pickle that could run code: every ``torch.load`` says ``weights_only=True``
    and no ``np.load`` allows pickles (the checkpoint paths are exercised in the tables above)."""
    loads = []
    for path in sorted((REPO / "nmtcore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                owner = ast.unparse(node.func.value)
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if owner == "torch":
                    loads.append(path.name)
                    assert kw.get("weights_only") == "True", f"{path}:{node.lineno}: torch.load without weights_only"
                if owner in ("np", "numpy"):
                    assert kw.get("allow_pickle", "False") == "False", f"{path}:{node.lineno}: np.load allows pickles"
    assert "checkpoint.py" in loads


def test_ray_dashboard_and_mlflow_ui_bind_to_localhost(world: World, tmp_path: Path, capsys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import search_spaces
    from nmtcore.cli import sweep as cli
    from nmtcore.sweep import driver
    from nmtcore.sweep import ray_backend
    from nmtcore.sweep import settings as sweep_settings
    from nmtcore.sweep.ray_backend import cluster as rb_cluster

    assert sweep_settings.SweepSettings(name="s", storage=str(tmp_path)).dashboard_host == "127.0.0.1"
    assert inspect.signature(ray_backend.init_ray).parameters["dashboard_host"].default == "127.0.0.1"
    # The entry points leave it at the default...
    seen: dict[str, Any] = {}

    def stop(space, base, settings, **kw):
        seen["settings"] = settings
        raise sweep_settings.SweepError("stopped before Ray")

    monkeypatch.setattr(driver, "run_sweep", stop)
    monkeypatch.setattr(sys, "argv", ["sweeps/sweep.py"])
    assert cli.main(search_spaces.MODULES["transformer_grid"], sweep_args(world, tmp_path, "demo")) == 2
    assert capsys.readouterr().err == "sweep.py: error: stopped before Ray\n"
    assert seen["settings"].dashboard_host == "127.0.0.1" and seen["settings"].dashboard
    # ...and init_ray hands it to ray.init (faked: no cluster starts).
    for k, v in ray_backend.RAY_ENV.items():
        monkeypatch.setenv(k, v)  # init_ray sets defaults in os.environ; monkeypatch restores them
    calls: dict[str, Any] = {}
    monkeypatch.setattr(rb_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rb_cluster.ray, "init", lambda **kw: calls.update(kw) or SimpleNamespace(dashboard_url=None))
    ray_backend.init_ray(num_cpus=1)
    assert calls["dashboard_host"] == "127.0.0.1" and calls["include_dashboard"] is True
    # The MLflow UI command printed after a sweep serves a local store on 127.0.0.1 only.
    ui = tracking.ui_command(world.uri)
    assert "--host 127.0.0.1" in ui and "0.0.0.0" not in ui


def test_resume_from_a_checkpoint_of_another_vocabulary(world: World, cli, tmp_path: Path) -> None:
    """An output dir holding a run with other data settings: resuming it names the checkpoint, and the
    checkpoint stays as it was."""
    out = tmp_path / "run"
    assert cli("train", "--config", world.config, "--output-dir", out, "--no-track").code == 0
    before = {p: p.stat().st_mtime_ns for p in files_under(out)}
    r = cli("train", "--config", world.config, "--output-dir", out, "--no-track", "--set", "data.vocab_size=80",
            "train.max_epochs=2")
    line = one_line_error(r, str(out / "checkpoints" / "epoch1.pt"), "vocabulary", "--no-resume")
    assert world.other_vocab.checksum[:12] in line
    assert {p: p.stat().st_mtime_ns for p in files_under(out)} == before
