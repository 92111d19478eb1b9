"""zeroplus.budget: what each rank will hold, predicted before anything is allocated.

``model_states.py``: model-state bytes per category for any world size, from the partition code.
(The memory-budget issue builds the rest here: activations, buffers, the report and the planner.)
"""
from .model_states import model_state_bytes
from .virtual_group import VirtualGroup

__all__ = ["VirtualGroup", "model_state_bytes"]
