"""Reference models that run on packed rows: ``GPT`` (plain PyTorch, RoPE, GQA)."""

from flexpack.models.gpt import GPT, GPTConfig, position_ids_from_doc_ids

__all__ = ["GPT", "GPTConfig", "position_ids_from_doc_ids"]
