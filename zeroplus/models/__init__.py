"""Built-in models."""
from .gpt import GPT, GPTConfig, gpt_config

__all__ = ["GPT", "GPTConfig", "gpt_config"]
