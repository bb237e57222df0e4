"""A package index on 127.0.0.1 serving wheels made in the test, and a tiny MPNet to put in them: how the
offline fetch of all-mpnet-base-v2 (:mod:`nmtcore.bert.sources`) is tested without the real index."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import re
import threading
import zipfile
from pathlib import Path
from typing import Iterator

import torch


def save_tiny_mpnet(path: Path, layers: int = 2, hidden: int = 32, seed: int = 0) -> Path:
    """A random ``MPNetModel`` (no token types, RoBERTa-style positions) with its WordPiece tokenizer."""
    from transformers import MPNetConfig, MPNetModel, MPNetTokenizer

    from nmtcore.testing.tiny_bert import WORDPIECES

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]"] + WORDPIECES + ["<mask>"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    MPNetTokenizer(vocab=str(path / "vocab.txt")).save_pretrained(str(path))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MPNetModel(MPNetConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                                       num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=66,
                                       pad_token_id=1))
    model.save_pretrained(str(path))
    return path


def split_zip_wheels(model_dir: Path, out: Path, dist_prefix: str, n_parts: int, archive: str) -> list[tuple[str, str]]:
    """Zip ``model_dir`` as ``<archive>/…``, cut the zip into ``n_parts`` pieces and wrap piece ``i`` in the
    wheel ``<dist_prefix>-00i`` 0.0.1 (as the real all-mpnet-base-v2 parts are). Returns ``(requirement,
    sha256)`` per wheel, in order."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(model_dir.iterdir()):
            zf.write(f, f"{archive}/{f.name}")
    blob = buf.getvalue()
    size = -(-len(blob) // n_parts)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(1, n_parts + 1):
        dist = f"{dist_prefix}-{i:03d}"
        stem = dist.replace("-", "_")
        wheel = out / f"{stem}-0.0.1-py3-none-any.whl"
        info = f"{stem}-0.0.1.dist-info"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{stem}/input/{archive}.zip.{i:03d}", blob[(i - 1) * size : i * size])
            zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
            zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: nmtcore-tests\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n")
            zf.writestr(f"{info}/RECORD", "")
        parts.append((f"{dist}==0.0.1", hashlib.sha256(wheel.read_bytes()).hexdigest()))
    return parts


@contextlib.contextmanager
def serve_index(wheels: Path) -> Iterator[str]:
    """A PEP 503 simple index of the wheels in ``wheels`` on 127.0.0.1; yields its ``/simple`` URL."""
    files = sorted(wheels.glob("*.whl"))

    def project(whl: Path) -> str:
        return re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            body, ctype = None, "text/html"
            if parts[:1] == ["simple"] and len(parts) == 2:
                links = [f'<a href="/files/{f.name}">{f.name}</a>' for f in files if project(f) == parts[1]]
                body = ("<html><body>" + "".join(links) + "</body></html>").encode() if links else None
            elif parts[:1] == ["files"] and len(parts) == 2 and (wheels / parts[1]).is_file():
                body, ctype = (wheels / parts[1]).read_bytes(), "application/octet-stream"
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
