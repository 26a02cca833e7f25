"""Tiny LitGPT checkpoints built offline, for tests, benchmarks and a first try of the integration.

A LitGPT checkpoint directory holds ``lit_model.pth`` (the state dict), ``model_config.yaml`` (the
``litgpt.Config``) and the tokenizer files. :func:`tiny_checkpoint` writes one with random weights
and a byte-level tokenizer (:func:`write_byte_tokenizer`: one token per UTF-8 byte, no merges, no
download), so ``litgpt``'s own ``Tokenizer``, ``GPT`` and ``load_checkpoint`` read it as they read
a downloaded model. litgpt and tokenizers are imported inside the functions (extra ``litgpt``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["BYTE_VOCAB_SIZE", "tiny_checkpoint", "write_byte_tokenizer"]

# <unk>, <s>, </s>, then the 256 byte symbols of the byte-level alphabet.
BYTE_VOCAB_SIZE = 259


def write_byte_tokenizer(directory: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a byte-level tokenizer.

    Ids: 0 ``<unk>``, 1 ``<s>`` (BOS, added by LitGPT's ``Tokenizer.encode``), 2 ``</s>`` (EOS),
    3 + b for byte b. Built with ``tokenizers`` in memory: nothing is downloaded.

    Args:
        directory: where to write (created if missing).

    Returns:
        ``Path(directory)``.

    Example (needs litgpt; these run in tests/test_integrations_litgpt.py)::

            import tempfile
            from litgpt.tokenizer import Tokenizer
            tok = Tokenizer(write_byte_tokenizer(tempfile.mkdtemp()))
            tok.encode("hi", eos=True).tolist()
            # -> [1, 107, 108, 2]
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte, symbol in enumerate(_byte_symbols()):
        vocab[symbol] = 3 + byte  # byte b is token 3 + b
    assert len(vocab) == BYTE_VOCAB_SIZE
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def _byte_symbols() -> list[str]:
    """The printable character that byte-level BPE (GPT-2's ``bytes_to_unicode``) uses for each
    byte 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_checkpoint(
    directory: str | Path, config: Any = None, *, seed: int = 0, init_std: float = 0.2
) -> Path:
    """Write a LitGPT checkpoint directory with random weights and the byte tokenizer.

    Args:
        directory: the checkpoint directory (created if missing).
        config: a ``litgpt.Config`` or a dict of its fields; default a 2-layer Llama-shaped model
            (width 64, 4 query / 2 key-value heads, RMSNorm, SwiGLU, block size 512). Its
            ``vocab_size`` should cover the byte tokenizer's 259 ids.
        seed: seeds the weights.
        init_std: standard deviation of the normal weight init (biases 0); LitGPT's 0.02 makes
            logits nearly uniform, so tests that must see a leak use larger weights.

    Returns:
        ``Path(directory)``, holding ``lit_model.pth``, ``model_config.yaml``,
        ``tokenizer.json`` and ``tokenizer_config.json``.

    Example (needs litgpt; these run in tests/test_integrations_litgpt.py)::

            import tempfile
            from litgpt.utils import check_valid_checkpoint_dir
            check_valid_checkpoint_dir(tiny_checkpoint(tempfile.mkdtemp()))
    """
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    if config is None:
        config = Config(
            name="tiny-llama",
            block_size=512,
            vocab_size=BYTE_VOCAB_SIZE,
            padding_multiple=64,
            n_layer=2,
            n_head=4,
            n_query_groups=2,
            n_embd=64,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=128,
        )
    elif isinstance(config, dict):
        config = Config(**config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights: around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=generator))
    torch.save(model.state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    write_byte_tokenizer(directory)
    return directory
