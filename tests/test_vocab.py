"""SubwordVocab: exact round trip, special ids, caching and atomic writes, clear errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nmtcore.data import SubwordVocab, VocabError
from nmtcore.data import vocab as tokenization

DE = ["Zwei", "junge", "weiße", "Männer", "sind", "im", "Freien", "in", "der", "Nähe", "vieler", "Büsche.",
      "Ein", "kleines", "Mädchen", "klettert", "über", "Straße,", "Größe:", "„Hallo!“", "(3)", "42", "—",
      "ß"]
EN = ["Two", "young", "white", "men", "are", "outside", "near", "many", "bushes.", "A", "little", "girl",
      "climbs", "\"quoted\"", "it's", "1,000", "dogs;", "e.g.", "50%", "café", "naïve", "?", "#1", "&"]


def make_lines(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("text")
    files = []
    for lang, words, seed in (("de", DE, 1), ("en", EN, 2)):
        f = d / f"train.{lang}"
        f.write_text("\n".join(make_lines(words, 300, seed)) + "\n", encoding="utf-8")
        files.append(f)
    return files


@pytest.fixture(scope="module")
def vocab(corpus_files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SubwordVocab:
    return SubwordVocab.train_or_load(corpus_files, 200, tmp_path_factory.mktemp("cache"))


def test_special_ids_and_size(vocab: SubwordVocab) -> None:
    assert (vocab.pad_id, vocab.unk_id, vocab.bos_id, vocab.eos_id) == (0, 1, 2, 3)
    assert len(vocab) == 200
    assert vocab.model_path.name == "spm.model" and vocab.model_path.is_file()
    assert len(vocab.checksum) == 64


@pytest.mark.parametrize("line", [
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "„Hallo!“ (3) Größe: 42 — ß",
    "Two \"quoted\" dogs; it's 1,000 e.g. 50% café naïve ? #1 &",
    "Männer café Straße, \"quoted\" (3)",  # unseen combination of seen characters
    "ö",  # a single character that is not a word of the training text
    "",
])
def test_exact_round_trip(vocab: SubwordVocab, line: str) -> None:
    ids = vocab.encode(line)
    assert vocab.unk_id not in ids
    assert vocab.bos_id not in ids and vocab.eos_id not in ids
    assert vocab.decode(ids) == line


def test_round_trip_every_training_line(vocab: SubwordVocab, corpus_files: list[Path]) -> None:
    lines = [ln for f in corpus_files for ln in f.read_text(encoding="utf-8").splitlines()]
    assert vocab.decode_many(vocab.encode_many(lines)) == lines


def test_unseen_character_becomes_unk(vocab: SubwordVocab) -> None:
    # Documented limitation: no byte fallback, so a character absent from training text is unk and
    # decodes to " ⁇ "; the rest of the line survives.
    ids = vocab.encode("Männer 😀 sind")
    assert vocab.unk_id in ids
    out = vocab.decode(ids)
    assert "\u2047" in out and out.startswith("Männer") and out.endswith("sind")


def test_encode_many_matches_encode(vocab: SubwordVocab) -> None:
    lines = make_lines(DE + EN, 50, seed=3)
    many = vocab.encode_many(lines)
    assert all(a.dtype == np.int32 for a in many)
    assert [a.tolist() for a in many] == [vocab.encode(ln) for ln in lines]


def test_decode_strips_specials_and_cuts_at_eos(vocab: SubwordVocab) -> None:
    ids = vocab.encode("junge Männer")
    b, e, p = vocab.bos_id, vocab.eos_id, vocab.pad_id
    assert vocab.decode([b, *ids, e, *ids, p]) == "junge Männer"
    assert vocab.decode(np.array([b, *ids, e, p, p])) == "junge Männer"
    assert vocab.decode(torch.tensor([b, *ids, p, e, *ids])) == "junge Männer"
    assert vocab.decode([e, *ids]) == ""
    assert vocab.decode_many([[b, *ids, e, 5], ids]) == ["junge Männer", "junge Männer"]


def test_cache_hit_does_not_retrain(corpus_files: list[Path], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first = SubwordVocab.train_or_load(corpus_files, 150, tmp_path)
    mtime = first.model_path.stat().st_mtime_ns

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained on a cache hit")

    monkeypatch.setattr(tokenization, "_train", boom)
    second = SubwordVocab.train_or_load(corpus_files, 150, tmp_path)
    assert second.model_path == first.model_path and second.checksum == first.checksum
    assert second.model_path.stat().st_mtime_ns == mtime
    assert first.model_path.parent.parent == tmp_path / "vocab"
    # Another size is another vocabulary: a miss, so it would train.
    with pytest.raises(AssertionError, match="retrained"):
        SubwordVocab.train_or_load(corpus_files, 160, tmp_path)


def test_the_same_text_gives_the_same_vocabulary_bytes_in_any_cache(corpus_files: list[Path], tmp_path: Path) -> None:
    """The checksum names the vocabulary, not its build: two builds in two cache directories (other temporary
    paths, other process state) give identical model files, so checkpoints and cached baselines carry over."""
    first = SubwordVocab.train_or_load(corpus_files, 150, tmp_path / "a")
    second = SubwordVocab.train_or_load(corpus_files, 150, tmp_path / "elsewhere" / "b")
    assert first.model_path != second.model_path
    assert first.model_path.read_bytes() == second.model_path.read_bytes() and first.checksum == second.checksum
    assert str(tmp_path).encode() not in first.model_path.read_bytes()  # no build path recorded in the model
    readable = first.model_path.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(readable) == len(first) and readable[5].split("\t")[0] == first.sp.id_to_piece(5)


def test_cache_key_depends_on_content_not_name(corpus_files: list[Path], tmp_path: Path) -> None:
    copy = tmp_path / "renamed.txt"
    copy.write_bytes(corpus_files[0].read_bytes())
    assert tokenization.training_key([copy, corpus_files[1]], 100) == tokenization.training_key(corpus_files, 100)
    copy.write_bytes(corpus_files[0].read_bytes() + b"one more line\n")
    assert tokenization.training_key([copy, corpus_files[1]], 100) != tokenization.training_key(corpus_files, 100)
    assert tokenization.training_key(corpus_files, 100) != tokenization.training_key(corpus_files, 101)


def test_interrupted_training_leaves_nothing(corpus_files: list[Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_die(texts: object, vocab_size: int, model_file: Path) -> None:
        model_file.write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenization, "_train", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        SubwordVocab.train_or_load(corpus_files, 150, tmp_path)
    assert list((tmp_path / "vocab").iterdir()) == []
    monkeypatch.undo()
    v = SubwordVocab.train_or_load(corpus_files, 150, tmp_path)  # next run trains for real
    assert len(v) == 150


def test_vocab_too_large_is_one_line_error(corpus_files: list[Path], tmp_path: Path) -> None:
    with pytest.raises(VocabError, match=r"vocab_size=50000 is too large .* at most \d+ .*lower data.vocab_size") as e:
        SubwordVocab.train_or_load(corpus_files, 50000, tmp_path)
    assert "\n" not in str(e.value)
    assert [p for p in (tmp_path / "vocab").iterdir()] == []


def test_vocab_too_small_is_one_line_error(corpus_files: list[Path], tmp_path: Path) -> None:
    with pytest.raises(VocabError, match=r"vocab_size=20 is too small.* must be >= \d+") as e:
        SubwordVocab.train_or_load(corpus_files, 20, tmp_path)
    assert "\n" not in str(e.value)


def test_load_by_path(vocab: SubwordVocab, tmp_path: Path) -> None:
    again = SubwordVocab.load(vocab.model_path)
    assert again.checksum == vocab.checksum and len(again) == len(vocab)
    assert again.encode("Männer") == vocab.encode("Männer")
    bad = tmp_path / "spm.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(VocabError, match="not a SentencePiece model"):
        SubwordVocab.load(bad)
    with pytest.raises(VocabError, match="cannot read"):
        SubwordVocab.load(tmp_path / "missing.model")


def test_checkpoint_payload_round_trip(vocab: SubwordVocab, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"vocab": vocab.to_tensor_payload()}, path)
    payload = torch.load(path, weights_only=True)["vocab"]  # checkpoints are loaded without pickle
    again = SubwordVocab.from_tensor_payload(payload)
    assert again.checksum == vocab.checksum and again.model_path is None
    assert again.encode("junge Männer") == vocab.encode("junge Männer")
    payload["model"][-1] ^= 1
    with pytest.raises(VocabError):
        SubwordVocab.from_tensor_payload(payload)


def test_round_trip_random_lines(vocab: SubwordVocab) -> None:
    chars = sorted(set("".join(DE + EN)))
    rng = random.Random(0)
    for _ in range(200):
        words = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
        line = " ".join(words)
        assert vocab.decode(vocab.encode(line)) == line


def test_file_names_with_commas(tmp_path: Path, corpus_files: list[Path]) -> None:
    # The trainer reads through a sentence iterator, so a comma in a path is not a file separator.
    d = tmp_path / "a,b"
    d.mkdir()
    files = []
    for f in corpus_files:
        files.append(d / f.name)
        files[-1].write_bytes(f.read_bytes())
    v = SubwordVocab.train_or_load(files, 120, tmp_path / "cache")
    assert len(v) == 120
    assert [p.name for p in (tmp_path / "cache" / "vocab").iterdir()] == [v.model_path.parent.name]
