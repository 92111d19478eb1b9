"""Byte-level text data for the main job: any text file or folder, by default the Python
standard library's own source files (every machine with Python has them, so nothing to download).

The corpus is read once into one uint8 tensor (``max_bytes`` at most); the last 5% is held out
for evaluation. Batches are random windows, seeded per rank and step, so runs repeat exactly.
"""
from __future__ import annotations

import os
import pathlib
import sysconfig

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_corpus(path: str | None, max_bytes: int = 8 << 20) -> torch.Tensor:
    """Read up to ``max_bytes`` of text straight into one uint8 tensor.

    Memory: the corpus's own bytes and nothing more: files are read into the tensor's buffer and the folder
    is walked lazily in sorted order. Collecting the file list, the chunks, their join and a copy held about
    three times the corpus, which put the example budget job (configs/auto_budget.json) over its budget.
    """
    root = pathlib.Path(path or default_corpus_dir())
    if not root.exists():
        raise ValueError(f"--data {str(root)!r} does not exist")
    out = torch.empty(max_bytes, dtype=torch.uint8)
    view, total = out.numpy().data, 0
    for f in _text_files(root):
        try:
            with open(f, "rb") as handle:
                total += handle.readinto(view[total:]) or 0
        except OSError:
            continue
        if total >= max_bytes:
            break
    view.release()
    if total < 4096:
        raise ValueError(f"--data {str(root)!r} holds only {total} bytes of text; need at least 4096")
    return out[:total]  # pages past ``total`` were never touched, so they cost no resident memory


def _text_files(root: pathlib.Path):
    """Text files under ``root`` in sorted order, one folder at a time (or ``root`` itself if it is a file)."""
    if root.is_file():
        yield root
        return
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(TEXT_SUFFIXES):
                yield pathlib.Path(folder) / name


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
        # contiguous, as a data loader's batches are: strided ids and targets run other kernels in the model's
        # embedding and loss, whose code (4 MiB of libtorch_cpu.so here) no budget predicts
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.seed, self.rank, step, micro)) & 0x7FFFFFFF)
        return self._windows(self.train, g)

    def eval_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + index)
        return self._windows(self.held_out, g)


def corpus_description(path: str | None) -> str:
    return path if path else f"Python standard library sources ({default_corpus_dir()})"


__all__ = ["ByteBatches", "corpus_description", "read_corpus"]
