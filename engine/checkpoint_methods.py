"""What an engine saves and loads: DeepSpeed's checkpoint methods and the model exports, as ``Engine`` offers them.

``CheckpointMethods`` is ``Engine``'s base class for them: each method marks the phase for a fault dump and calls
the mechanism in ``engine/checkpoints/`` (training checkpoints: ``save.py``, ``load.py``, ``async_save.py``;
exports: ``export.py``, ``hf_export.py``; a Hugging Face checkpoint read into the shards: ``pretrained_load.py``),
which reads the engine through its partition, step and counters. A load waits for an asynchronous save first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from zeroplus import fault_dumps

from .checkpoints.async_save import AsyncSaves
from .checkpoints.export import save_16bit_model
from .checkpoints.hf_export import save_pretrained
from .checkpoints.load import load_checkpoint
from .checkpoints.pretrained_load import PretrainedLoad, load_pretrained
from .checkpoints.save import save_checkpoint

if TYPE_CHECKING:
    from .accessors import EngineAccessors as Engine  # the readings of an engine it uses


class CheckpointMethods:
    """Saving and loading, for ``Engine`` (every method is called on every rank)."""

    _saves: AsyncSaves  # an asynchronous save in flight (set by Engine)
    _checkpoint_saved: bool  # the report compares with the predicted peak that includes a save

    def _engine(self) -> Engine:
        return cast("Engine", self)

    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, keep_latest_k: int | None = None,
                        async_save: bool | None = None, format: str | None = None) -> str:
        """Every rank calls it; atomic (see ``engine/checkpoints/files.py``); tag defaults to global_stepN;
        ``save_latest`` False leaves ``save_dir/latest`` as it was; ``exclude_frozen_parameters``: the
        trained parameters' checkpoint only (an adapter's), loaded back with ``strict=False``;
        ``keep_latest_k`` (default ``zeroplus.keep_latest_k``): older checkpoints beyond the k newest removed
        once this one is committed; ``async_save`` (default ``zeroplus.async_save``): return once the state is
        staged, the file and the commit following in the background (``wait_for_checkpoint()``); ``format``
        (default ``zeroplus.checkpoint_format``): "dcp" writes a torch.distributed.checkpoint for FSDP2."""
        self._checkpoint_saved = True
        fault_dumps.set_phase("checkpoint save")
        return save_checkpoint(self._engine(), save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                               keep_latest_k, async_save, format)

    def wait_for_checkpoint(self) -> None:
        """Every rank calls it: wait until an asynchronous save is committed; raise if it failed."""
        self._saves.wait()

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, strict: bool = True) -> tuple[str, dict[str, Any]]:
        """Every rank calls it; any data-parallel size and stage; returns ``(path, client_state)``;
        ``strict`` False keeps the frozen parameters a checkpoint lacks."""
        self._saves.wait()  # an asynchronous save committed (or raising) first
        fault_dumps.set_phase("checkpoint load")
        return load_checkpoint(self._engine(), load_dir, tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               strict=strict)

    def load_pretrained(self, path: str, *, prefixes: dict[str, str] | None = None, allow_missing: Any = (),
                        strict: bool = True) -> PretrainedLoad:
        """Every rank calls it: a Hugging Face checkpoint (directory or file; safetensors or .bin, sharded or
        not) read straight into this rank's shards (``engine/checkpoints/pretrained_load.py``)."""
        return load_pretrained(self._engine(), path, prefixes=prefixes, allow_missing=allow_missing, strict=strict)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> str | None:
        """Gather the whole model in the compute dtype into one file on rank 0 (every rank calls
        it: at stages 1-3 the masters are all-gathered). Returns the path on rank 0.
        ``exclude_frozen_parameters``: the trained parameters and the buffers only (an adapter)."""
        return save_16bit_model(self._engine(), save_dir, save_filename, exclude_frozen_parameters)

    def save_pretrained(self, save_dir: str, dtype: str | None = None, max_shard_size: str | int = "5GB"
                        ) -> list[str] | None:
        """Every rank calls it: the model in Hugging Face's sharded safetensors layout (files of at most
        ``max_shard_size``, ``model.safetensors.index.json``, ``config.json`` when the model has one), in
        ``dtype`` (``fp32``, ``bf16``, ``fp16``; default the compute dtype), one flat group gathered at a time
        (``engine/checkpoints/hf_export.py``). Returns the file names on rank 0, None elsewhere."""
        return save_pretrained(self._engine(), save_dir, dtype, max_shard_size)
