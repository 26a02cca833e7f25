"""Reference models that run on packed rows: ``GPT`` (plain PyTorch, RoPE, GQA)."""

from flexpack.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
