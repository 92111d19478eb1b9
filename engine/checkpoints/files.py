"""Checkpoint files on disk: atomic commit, checksums, the ``latest`` pointer.

A save writes every rank's file into a hidden temporary directory ``.TAG.tmp-ID`` next to the
final one, fsyncs each file, and only after every rank has finished does rank 0 write
``metadata.json`` (with each file's SHA-256), fsync it and the directory, rename the temporary
directory to ``TAG``, and then replace ``latest`` (written to a temporary file, fsynced, renamed).
A process killed anywhere before the rename leaves only a hidden temporary directory, which
``latest`` never names; killed after it, ``latest`` still names the previous tag until its own
rename. Saving a tag that exists swaps the two directories in one atomic exchange (Linux's
``renameat2(RENAME_EXCHANGE)``), so ``TAG`` is always a complete checkpoint, old or new; where the
filesystem cannot exchange, re-saving a tag is refused. What a killed save leaves behind (hidden
``.TAG.tmp-*`` directories, ``.latest.tmp-*`` files) is removed by the next save in the same directory.
``ZEROPLUS_CHECKPOINT_FAULT=<point>`` kills the process at a named point (for tests that prove this).
See note: slice checkpoints (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
from typing import IO, Any, BinaryIO, cast

import torch

from .safe_load import load_weights_only

logger = logging.getLogger("zeroplus.checkpoint")

METADATA = "metadata.json"
LATEST = "latest"
DCP_METADATA = ".metadata"  # what torch.distributed.checkpoint writes last into a checkpoint directory
FORMAT_VERSION = 1


def non_persistent_buffers(module: torch.nn.Module) -> list[str]:
    """The qualified names of ``module``'s buffers its own ``state_dict()`` leaves out (``persistent=False``, as
    a rotary embedding's ``inv_freq``): a checkpoint keeps them for resuming, and its metadata lists them
    (``non_persistent_buffers``) so that an export writes exactly the model's ``state_dict()`` keys."""
    return [f"{prefix}.{name}" if prefix else name for prefix, m in module.named_modules()
            for name, b in m.named_buffers(recurse=False) if b is not None and name in m._non_persistent_buffers_set]


def exported_extra(meta: dict[str, Any], extra: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """Rank 0's ``module_extra`` less the buffers the model's ``state_dict()`` does not hold. A checkpoint written
    before the metadata listed them exports every buffer, with a warning naming it."""
    skip = meta.get("non_persistent_buffers")
    if skip is None:
        logger.warning("checkpoint %s does not list the model's non-persistent buffers (written before zeroplus "
                       "recorded them): every buffer it holds is exported, and from_pretrained or "
                       "load_state_dict may report some as unexpected keys", path)
        return dict(extra)
    return {n: v for n, v in extra.items() if n not in set(skip)}


def whole_parameter(pieces: list[tuple[int, int, torch.Tensor]], offset: int, numel: int) -> torch.Tensor:
    """One parameter's elements ``[offset, offset + numel)`` of a flat group, from the ``(lo, hi, values)`` ranges
    the rank files hold."""
    out = torch.empty(numel, dtype=pieces[0][2].dtype)
    for lo, hi, values in pieces:
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            out[a - offset:b - offset] = values[a - lo:b - lo]
    return out


def fault_point(name: str) -> None:
    """Die here, without cleanup, if the environment asks for it (crash-safety tests)."""
    if os.environ.get("ZEROPLUS_CHECKPOINT_FAULT") == name:
        os._exit(17)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def write_bytes_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _HashingFile:
    """A write-only file that hashes what passes through it (torch.save streams into it)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha256 = f, hashlib.sha256()
        self.error: OSError | None = None  # the file's own error (torch.save reports another)

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_rank_state(directory: str, rank: int, state: dict[str, Any], global_rank: int | None = None) -> str:
    """Write one rank's state durably, streamed (no in-memory copy of the file); return its SHA-256.
    A failed write (a full disk) is an ``OSError`` naming the file and the rank."""
    path = os.path.join(directory, rank_file(rank))
    out = None
    try:
        with open(path, "wb") as f:
            out = _HashingFile(f)
            torch.save(state, cast(IO[bytes], out))  # (torch only calls write and flush)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError
        err = out.error if out is not None and out.error is not None else err
        code = getattr(err, "errno", None) or errno.EIO
        raise OSError(code, f"rank {rank if global_rank is None else global_rank} could not write checkpoint file "
                            f"{path}: {err}") from None
    return out.sha256.hexdigest()


def _rank_path(directory: str, rank: int) -> str:
    path = os.path.join(directory, rank_file(rank))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} (rank {rank}'s shard) is missing")
    return path


def _check_digest(path: str, rank: int, digest: str, expected_sha256: str) -> None:
    if digest != expected_sha256:
        raise ValueError(f"checkpoint file {path} (rank {rank}'s shard) is corrupt: SHA-256 {digest[:16]}... "
                         f"does not match {expected_sha256[:16]}... recorded in {METADATA}")


def load_rank_state(directory: str, rank: int, expected_sha256: str) -> dict[str, Any]:
    path = _rank_path(directory, rank)
    with open(path, "rb") as f:
        data = f.read()
    _check_digest(path, rank, hashlib.sha256(data).hexdigest(), expected_sha256)
    return load_weights_only(data, what=f"checkpoint file {path} (rank {rank}'s shard)")


def map_rank_state(directory: str, rank: int, expected_sha256: str) -> dict[str, Any]:
    """``load_rank_state`` without reading the file into memory: its SHA-256 taken in 16 MiB pieces, then its
    tensors mapped (paged in when touched; the exports copy ranges out of them)."""
    path = _rank_path(directory, rank)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            digest.update(piece)
    _check_digest(path, rank, digest.hexdigest(), expected_sha256)
    return load_weights_only(path, what=f"checkpoint file {path} (rank {rank}'s shard)", mmap=True)


def write_metadata(directory: str, metadata: dict[str, Any]) -> None:
    write_bytes_durably(os.path.join(directory, METADATA), json.dumps(metadata, indent=1).encode())
    _fsync_dir(directory)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where the
    platform or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def can_replace(final_dir: str) -> None:
    """Before anything is written: refuse to re-save an existing tag where it cannot be swapped atomically."""
    if not os.path.exists(final_dir):
        return
    probe = os.path.join(os.path.dirname(final_dir), f".exchange-probe-{os.getpid()}")
    os.makedirs(probe, exist_ok=True)
    try:
        if not _exchange(probe, final_dir) or not _exchange(probe, final_dir):
            raise ValueError(f"checkpoint tag {os.path.basename(final_dir)!r} exists in {os.path.dirname(final_dir)} "
                             f"and this filesystem cannot replace a directory atomically: save under a new tag, or "
                             f"remove the old one first")
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def commit(tmp_dir: str, final_dir: str, metadata: dict[str, Any] | None) -> None:
    """Rank 0, after every rank wrote its file: metadata (None: a DCP checkpoint, whose own metadata is there
    already), then rename into place (or swap with the tag saved before, which then sits in ``tmp_dir`` and is
    removed)."""
    if metadata is not None:
        write_metadata(tmp_dir, metadata)
    fault_point("before_rename")
    parent = os.path.dirname(final_dir)
    if os.path.exists(final_dir):
        if not _exchange(tmp_dir, final_dir):
            raise ValueError(f"cannot replace {final_dir} atomically on this filesystem")
        _fsync_dir(parent)
        fault_point("after_exchange")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return
    os.rename(tmp_dir, final_dir)
    _fsync_dir(parent)


def remove_stale(save_dir: str) -> None:
    """Rank 0, before a save: what killed saves left in ``save_dir`` (hidden temporary directories and
    ``latest`` files; a save running now in the same directory from another job would lose its own)."""
    if not os.path.isdir(save_dir):
        return
    for entry in os.listdir(save_dir):
        if entry.startswith(".") and (".tmp-" in entry or entry.startswith(".exchange-probe-")):
            path = os.path.join(save_dir, entry)
            logger.warning("removing %s, left by a checkpoint save that did not finish", path)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def keep_latest(save_dir: str, k: int, keep: str) -> list[str]:
    """Rank 0, after a save committed: remove all but the ``k`` newest complete checkpoints (zeroplus's or DCP's) in
    ``save_dir`` (by commit: their metadata's time), never ``keep`` (the tag just saved) nor the one ``latest``
    names; other directories (DeepSpeed's tags, anything else) are left alone. Each is first renamed to a
    hidden temporary name (what ``remove_stale`` clears if this dies halfway), so a tag is either whole or
    gone. Returns the tags removed; a removal that fails is logged, not raised (the save itself is done)."""
    latest = os.path.join(save_dir, LATEST)
    pinned = {keep}
    if os.path.isfile(latest):
        with open(latest) as f:
            pinned.add(f.read().strip())
    marks = {t: os.path.join(save_dir, t, m) for t in os.listdir(save_dir) if not t.startswith(".")
             for m in (DCP_METADATA, METADATA) if os.path.isfile(os.path.join(save_dir, t, m))}
    tags = sorted(marks, key=lambda t: os.path.getmtime(marks[t]), reverse=True)
    removed = []
    for tag in tags[k:]:
        if tag in pinned:
            continue
        doomed = os.path.join(save_dir, f".{tag}.tmp-removing-{os.getpid()}")
        try:
            os.rename(os.path.join(save_dir, tag), doomed)
            _fsync_dir(save_dir)
            shutil.rmtree(doomed)
            removed.append(tag)
        except OSError as err:
            logger.warning("keep_latest_k: could not remove checkpoint %s: %s", os.path.join(save_dir, tag), err)
    return removed


def write_latest(save_dir: str, tag: str) -> None:
    fault_point("before_latest")
    tmp = os.path.join(save_dir, f".{LATEST}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, tag.encode())
    os.replace(tmp, os.path.join(save_dir, LATEST))
    _fsync_dir(save_dir)


def resolve_tag(load_dir: str, tag: str | None) -> str:
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no tag given and {latest} does not exist: nothing to resume from in {load_dir}")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, METADATA)):
        tags = sorted(t for t in os.listdir(load_dir) if os.path.isfile(os.path.join(load_dir, t, METADATA)))
        raise FileNotFoundError(f"checkpoint tag {tag!r} not found in {load_dir} (complete checkpoints there: {tags})")
    return tag


def read_metadata(path: str) -> dict[str, Any]:
    with open(os.path.join(path, METADATA)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{os.path.join(path, METADATA)} has format {meta.get('format')!r}; this zeroplus reads "
                         f"format {FORMAT_VERSION}")
    return meta
