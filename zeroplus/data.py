"""Byte-level text data for the main job: any text file or folder, by default the Python
standard library's own source files (every machine with Python has them, so nothing to download).

The corpus is read once into one uint8 tensor (``max_bytes`` at most); the last 5% is held out
for evaluation. Batches are random windows, seeded per rank and step, so runs repeat exactly.
"""
from __future__ import annotations

import pathlib
import sysconfig

import torch


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_corpus(path: str | None, max_bytes: int = 8 << 20) -> torch.Tensor:
    root = pathlib.Path(path or default_corpus_dir())
    if not root.exists():
        raise ValueError(f"--data {str(root)!r} does not exist")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in
                                                 (".py", ".txt", ".md", ".rst"))
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 4096:
        raise ValueError(f"--data {str(root)!r} holds only {total} bytes of text; need at least 4096")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteBatches:
    def __init__(self, corpus: torch.Tensor, seq_len: int, micro_batch: int, rank: int, seed: int = 0) -> None:
        split = int(len(corpus) * 0.95)
        self.train, self.held_out = corpus[:split], corpus[split:]
        self.seq_len, self.micro_batch, self.rank, self.seed = seq_len, micro_batch, rank, seed
        if len(self.held_out) <= seq_len + 1:
            raise ValueError(f"corpus of {len(corpus)} bytes is too small for sequences of {seq_len}")

    def _windows(self, data: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.micro_batch,), generator=g)
        rows = torch.stack([data[s:s + self.seq_len + 1] for s in starts.tolist()]).long()  # (b, t+1)
        return rows[:, :-1], rows[:, 1:]

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.seed, self.rank, step, micro)) & 0x7FFFFFFF)
        return self._windows(self.train, g)

    def eval_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + index)
        return self._windows(self.held_out, g)


def corpus_description(path: str | None) -> str:
    return path if path else f"Python standard library sources ({default_corpus_dir()})"


__all__ = ["ByteBatches", "corpus_description", "read_corpus"]
