"""Training checkpoints: save, load, export, DeepSpeed import, pretrained weights at shard memory.

Under the engine, not beside it: every file here reads the engine's training state (the partition's flat
groups, the sharded step's optimizer states, the counters) and a load writes it back, so this package is the
engine's own persistence, one layer with it. It talks to the engine through a small public surface only:
``engine.partition`` (flat groups, units), ``engine.sharded_step`` (optimizer states), ``engine.counters()``
and ``engine.set_counters()`` (steps, samples, micro-steps), ``engine.optimizer``, ``loss_scaler`` and
``lr_scheduler``. "Checkpoint" here always means a training checkpoint; activation checkpointing is
``zeroplus/activations/checkpointing.py`` (public as ``zeroplus.checkpointing``).

- ``save.py``: ``save_checkpoint`` (each rank's file, streamed from the training state; atomic through
  ``files.py``) and ``rank_state``, which the budget's simulation runs too.
- ``load.py``: ``load_checkpoint``, all-or-nothing: every rank reads and checks everything, the ranks agree,
  then anything is written; elastic over world sizes, stages and groupings.
- ``files.py``: the directory layout, ``latest``, metadata and the atomic swap of a tag.
- ``safe_load.py``: torch's weights-only unpickler for every file read.
- ``export.py``: consolidated fp32 and 16-bit state dicts; ``deepspeed_import.py``: DeepSpeed ZeRO-1/2/3
  checkpoints converted; ``pretrained_load.py`` and ``safetensors_ranges.py``: Hugging Face weights read
  straight into this rank's shards.
"""
