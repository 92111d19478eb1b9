"""The activation tiers on their own: exact round trips, cleanup, and clear errors.

FileTier: tensors of several dtypes and layouts (including a non-contiguous view) come back bit
for bit, with or without a prefetch, and each file is gone once read; ``close`` removes the
process's directory; a directory left by a dead process is removed when the next tier starts in
the same path while a live process's directory is kept; an unusable path is an error naming it,
also through the engine's config. HostTier on a CPU-only machine keeps the tensor itself and
says it saves nothing. With ``direct`` the large tensors' files are O_DIRECT files padded to the
block size, read back bit for bit into aligned buffers.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zeroplus
from tests.models import ParityNet
from zeroplus.accelerator import Accelerator
from zeroplus.ledger import Ledger
from zeroplus.offload import direct_io
from zeroplus.offload.tiers import FileTier, HostTier


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return [base, base.to(torch.bfloat16), base.t()[::2], torch.randint(-10**12, 10**12, (33,), generator=g),
            torch.randn(0), torch.tensor(3.5)]


def test_file_tier_round_trips_bitwise_and_cleans_up(tmp_path):
    tier = FileTier(str(tmp_path), Ledger())
    tensors = _tensors()
    stored = [tier.put(t) for t in tensors]
    for i, s in enumerate(stored):
        if i % 2:
            tier.prefetch(s)
    for t, s in zip(tensors, stored):
        back = tier.get(s)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert os.listdir(tier.directory) == []
    tier.close()
    assert not os.path.exists(tier.directory)


@pytest.mark.parametrize("direct", [False, True])
def test_direct_io_files_are_aligned_and_round_trip_bitwise(tmp_path, direct):
    """Tensors of at least ``direct_io.MIN_BYTES`` go through O_DIRECT files padded to the block
    size where the filesystem takes them; smaller ones and buffered tiers keep exact sizes."""
    tier = FileTier(str(tmp_path), Ledger(), direct=direct)
    assert tier.direct == (direct and direct_io.probe(tier.directory))
    g = torch.Generator().manual_seed(1)
    big = torch.randn(3, 40_001, generator=g)           # 480,012 bytes: not a multiple of 4 KiB
    tensors = [big, big[:, ::3], big.to(torch.bfloat16), torch.randn(10, generator=g)]
    stored = [tier.put(t) for t in tensors]
    for s in stored:
        s.ready.result()
    sizes = [os.path.getsize(s.data) for s in stored]
    for t, s, size in zip(tensors, stored, sizes):
        nbytes = t.numel() * t.element_size()
        expect = direct_io.padded(nbytes) if tier.direct and nbytes >= direct_io.MIN_BYTES else nbytes
        assert size == expect, (t.shape, t.dtype, size)
        back = tier.get(s)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        assert back.data_ptr() % (direct_io.ALIGN if size != nbytes else 1) == 0
    assert os.listdir(tier.directory) == []
    tier.close()


def test_directories_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_dir = tmp_path / f"zeroplus-swap-{int(dead.stdout)}"
    dead_labelled = tmp_path / f"zeroplus-swap-{int(dead.stdout)}-optimizer"  # an offload tier's directory
    live_dir = tmp_path / f"zeroplus-swap-{os.getppid()}-param"
    for d in (dead_dir, dead_labelled, live_dir):
        d.mkdir()
        (d / "0.bin").write_bytes(b"x" * 10)
    tier = FileTier(str(tmp_path), Ledger())
    assert not dead_dir.exists() and not dead_labelled.exists() and live_dir.exists()
    tier.close()


def test_unusable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="a-file"):
        FileTier(str(blocker / "swap"), Ledger())
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
           "zeroplus": {"log_level": "warning", "memory_estimate": False,
                        "swap_attention": {"enabled": True, "modules": ["ParityBlock"]},
                        "activation_tier": {"device": "file", "path": str(blocker / "swap")}}}
    with pytest.raises(zeroplus.ConfigError, match="zeroplus.activation_tier"):
        zeroplus.initialize(ParityNet(), cfg)


def test_host_tier_on_cpu_keeps_the_tensor():
    tier = HostTier(Accelerator(), Ledger())
    t = torch.randn(10)
    assert not tier.saves_memory and tier.get(tier.put(t)) is t


@pytest.mark.parametrize("direct", [False, True])
def test_changed_swap_and_offload_files_are_errors_naming_them(tmp_path, direct):
    """A swap file (FileTier) or a kept offload file (keep) zero-filled at its own size after the write,
    as a failing disk or another process could leave it: the read that returns it raises naming the file;
    the same read of an intact file returns the values bit for bit."""
    from zeroplus.offload.tier_tensor import keep
    tier = FileTier(str(tmp_path), Ledger(), direct=direct)
    values = torch.randn(1 << 16)
    intact, broken = tier.put(values), tier.put(values)
    tier.wait_written(broken)
    with open(broken.data, "r+b") as f:
        f.write(bytes(os.path.getsize(broken.data)))
    assert torch.equal(tier.get(intact), values)
    with pytest.raises(OSError, match=rf"offload file {broken.data} is corrupt on rank 0: CRC-32"):
        tier.get(broken)
    kept = keep(tier, values.clone())
    kept.write(100, torch.ones(50))
    kept.read(0, 1 << 16).result()  # written as a whole, then in part: that range is no longer checked
    assert torch.equal(kept.read(100, 150).result(), torch.ones(50))
    with open(kept.path, "r+b") as f:
        f.seek(100 * 4)
        f.write(bytes(50 * 4))
    with pytest.raises(OSError, match=rf"offload file {kept.path} \(elements 100..150\) is corrupt"):
        kept.read(100, 150).result()
    kept.close()
    tier.close()
