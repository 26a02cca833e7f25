"""Offline stand-ins for the Hub repositories TRL's tests load (``trl-internal-testing/...``).

Used by ``bench/trl_sft_suite.py``; nothing here is flexpack API. Two kinds of stand-in:

- **Datasets**: TRL's own generator scripts (``scripts/generate_*_dataset.py`` from TRL's
  repository at the tests' commit) run with ``push_to_hub`` writing parquet files under
  ``<root>/datasets/<repo id>/<config>/<split>.parquet``; :data:`LOAD_DATASET` is the
  ``datasets.load_dataset`` wrapper the suite's conftest installs (other ids go to the real one).
- **Models**: ``trl-internal-testing/tiny-<Class>[-<suffix>]`` becomes a randomly initialised model
  of ``transformers.<Class>`` from the class's default config made tiny by
  :func:`flexpack.integrations._tiny.tiny_config`, in bfloat16 as TRL's tiny models are, with a
  byte-level BPE tokenizer learnt on the stand-in datasets (1024 tokens and the family's special
  tokens) carrying the family's chat template as TRL ships it (``trl/chat_templates/*.jinja``,
  so TRL recognises it and swaps in its training template for ``assistant_only_loss``). They
  are written into a Hugging Face Hub cache (``<root>/hub``, the layout ``huggingface_hub``
  reads with ``HF_HUB_OFFLINE=1``), so every loader (Auto classes, PEFT, TRL's own) finds them
  unpatched. ``tiny-RemoteForCausalLM`` carries TRL's own remote-code files.

What differs from the real repositories: the vocabulary (close in token counts on these texts),
the weights (random) and the config widths. Tests that assert on exact token ids or on
pretrained behaviour can differ; both sides of the comparison see the same stand-ins.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# Family of a tiny model id -> (chat template in trl/chat_templates, bos, eos, pad).
# bos/eos/pad follow the real tokenizers of the models TRL's tiny ones copy.
FAMILIES: dict[str, tuple[str | None, str | None, str, str | None]] = {
    "Qwen2ForCausalLM-2.5": ("qwen2_5", None, "<|im_end|>", "<|endoftext|>"),
    "Qwen3ForCausalLM": ("qwen3", None, "<|im_end|>", "<|endoftext|>"),
    "Qwen3MoeForCausalLM": ("qwen3", None, "<|im_end|>", "<|endoftext|>"),
    "GptOssForCausalLM": ("gptoss", "<|startoftext|>", "<|return|>", "<|endoftext|>"),
    "Cohere2ForCausalLM": ("cohere2", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<PAD>"),
    "CohereForCausalLM": ("cohere", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<PAD>"),
    "Glm4MoeForCausalLM": ("glm4moe", None, "<|endoftext|>", "<|endoftext|>"),
    "NemotronHForCausalLM-nano": ("nemotron_3_nano", None, "<|im_end|>", "<|endoftext|>"),
    "Olmo3ForCausalLM": ("qwen2_5", None, "<|im_end|>", "<|pad|>"),
    "Lfm2ForCausalLM": ("lfm2", "<|startoftext|>", "<|im_end|>", "<|pad|>"),
    "Lfm2ForCausalLM-2.5": ("lfm2_2_5", "<|startoftext|>", "<|im_end|>", "<|pad|>"),
    "LlamaForCausalLM-3": ("llama3", "<|begin_of_text|>", "<|eot_id|>", None),
    "LlamaForCausalLM-3.1": ("llama3_1", "<|begin_of_text|>", "<|eot_id|>", None),
    "LlamaForCausalLM-3.2": ("llama3_2", "<|begin_of_text|>", "<|eot_id|>", None),
    "MistralForCausalLM-0.1": (None, "<s>", "</s>", None),
    "MistralForCausalLM-0.2": (None, "<s>", "</s>", None),
    "GPTNeoXForCausalLM": (None, "<|endoftext|>", "<|endoftext|>", None),
    "Phi3ForCausalLM": ("phi3", "<s>", "<|endoftext|>", "<|endoftext|>"),
    "GemmaForCausalLM": ("gemma", "<bos>", "<eos>", "<pad>"),
    "Gemma2ForCausalLM": ("gemma", "<bos>", "<eos>", "<pad>"),
    "DeepseekV3ForCausalLM": ("deepseekv3", DEEPSEEK_BOS, DEEPSEEK_EOS, None),
    "DeepseekV3ForCausalLM-0528": ("deepseekv3", DEEPSEEK_BOS, DEEPSEEK_EOS, None),
}
# Other Hub models the tests name (``chat_template_path``) -> the family whose stand-in they get.
ALIASES = {"Qwen/Qwen3-4B": "Qwen3ForCausalLM"}
# Mistral's template as its v0.1/v0.2 tokenizers carry it (TRL ships none).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
SPECIAL = re.compile(r"<\|[^|\s'\"]{1,40}\|>|<｜[^｜]{1,40}｜>|<(?:start|end)_of_turn>|\[/?INST\]")
DATASET_SCRIPTS = {
    "trl-internal-testing/zen": "generate_zen_dataset.py",
    "trl-internal-testing/zen-image": "generate_zen_image_dataset.py",
    "trl-internal-testing/zen-multi-image": "generate_zen_multi_image_dataset.py",
    "trl-internal-testing/harmony": "generate_harmony_dataset.py",
    "trl-internal-testing/toolcall": "generate_toolcall_dataset.py",
}


def model_ids(test_source: str) -> list[str]:
    """The ``trl-internal-testing/tiny-*`` ids (and :data:`ALIASES`) a test file names."""
    ids = set(re.findall(r"trl-internal-testing/tiny-[\w.-]+", test_source))
    return sorted(ids | {a for a in ALIASES if f'"{a}"' in test_source})


def build_datasets(git_dir: str, commit: str, root: Path) -> dict[str, str]:
    """Run TRL's dataset generators at ``commit``; repo id -> why it has no stand-in."""
    from datasets import Dataset, DatasetDict

    missing = {}
    for repo_id, script in DATASET_SCRIPTS.items():
        show = ["git", "--git-dir", git_dir, "show", f"{commit}:scripts/{script}"]
        done = subprocess.run(show, capture_output=True, text=True)
        if done.returncode:
            missing[repo_id] = f"no scripts/{script} at {commit[:12]}"
            continue

        def push(self, repo, config_name="default", **_):
            for split, ds in self.items() if isinstance(self, DatasetDict) else [("train", self)]:
                out = root / "datasets" / repo / config_name / f"{split}.parquet"
                out.parent.mkdir(parents=True, exist_ok=True)
                ds.to_parquet(str(out))

        saved = DatasetDict.push_to_hub, Dataset.push_to_hub
        DatasetDict.push_to_hub = Dataset.push_to_hub = push
        try:
            module = types.ModuleType("_trl_dataset_script")  # its dataclass needs a module
            sys.modules[module.__name__] = module
            exec(compile(done.stdout, script, "exec"), module.__dict__)
            module.main(test_size=0.1, push_to_hub=True, repo_id=repo_id)
        except Exception as err:  # a generator this environment cannot run
            missing[repo_id] = f"{type(err).__name__}: {err}"
        finally:
            sys.modules.pop("_trl_dataset_script", None)
            DatasetDict.push_to_hub, Dataset.push_to_hub = saved
    return missing


def _template(name: str | None) -> str | None:
    if name is None:
        return None
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def _tokenizer(family: str, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template_name, bos, eos, pad = FAMILIES[family]
    template = MISTRAL if family.startswith("Mistral") else _template(template_name)
    specials = [t for t in (bos, eos, pad) if t]
    for token in SPECIAL.findall(template or ""):
        if token not in specials:
            specials.append(token)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # byte-level BPE learnt on the stand-in datasets' text: their words become single tokens,
    # so the samples are about as many tokens as with the real vocabularies
    trainer = trainers.BpeTrainer(
        vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(specials)
    if bos and family.startswith(("Llama", "Mistral", "Gemma", "Cohere", "Phi3", "Deepseek")):
        from tokenizers import processors

        # these tokenizers prepend their bos token, as the real ones do
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=template
    )
    return fast


def _snapshot(hub: Path, repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in a Hub cache, its ``refs/main`` pointing at it."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    sha = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    path = repo / "snapshots" / sha
    path.mkdir(parents=True, exist_ok=True)
    return path


REMOTE = "scripts/generate_tiny_models/for_causal_lm/_remote_code"


def build_remote(
    hub: Path, repo_id: str, texts: list[str], git_dir: str, commit: str
) -> str | None:
    """``tiny-RemoteForCausalLM``: a Llama under ``model_type="remote"`` whose classes are TRL's
    ``_remote_code`` files at ``commit``, loadable only with ``trust_remote_code=True``."""
    codes = {}
    for name in ("configuration_remote.py", "modeling_remote.py"):
        show = ["git", "--git-dir", git_dir, "show", f"{commit}:{REMOTE}/{name}"]
        done = subprocess.run(show, capture_output=True, text=True)
        if done.returncode:
            return f"no {REMOTE}/{name} at {commit[:12]}"
        codes[name] = done.stdout
    build_model(hub, repo_id, texts, family="LlamaForCausalLM-3.2")
    path = _snapshot(hub, repo_id)
    for name, code in codes.items():
        (path / name).write_text(code)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModel": "modeling_remote.RemoteModel",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
            "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
        },
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return None


def corpus(root: Path) -> list[str]:
    """Every string in the stand-in datasets (the tokenizers learn their merges on it)."""
    import pyarrow.parquet as pq

    out: list[str] = []

    def walk(value):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted((root / "datasets").rglob("*.parquet")):
        walk(pq.read_table(path).to_pylist())
    return out


def build_model(hub: Path, repo_id: str, texts: list[str], family: str | None = None) -> str | None:
    """Write the stand-in of ``repo_id`` into the cache; None, or why there is none."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from flexpack.integrations._tiny import tiny_config

    family = family or ALIASES.get(repo_id) or repo_id.split("/tiny-", 1)[1]
    if family not in FAMILIES:
        return "no stand-in for this family (vision-language)"
    cls = getattr(transformers, family.split("-")[0], None)
    if cls is None:
        return f"transformers {transformers.__version__} has no {family.split('-')[0]}"
    tokenizer = _tokenizer(family, texts)
    config = tiny_config(cls.config_class())
    config.vocab_size = len(tokenizer)
    for name in ("bos", "eos", "pad"):
        token = getattr(tokenizer, f"{name}_token")
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        setattr(config, f"{name}_token_id", token_id)
    config.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(config).to(torch.bfloat16)
    path = _snapshot(hub, repo_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(path)
    return None


def build(git_dir: str, commit: str, test_source: str, root: Path) -> dict[str, str]:
    """All stand-ins a test file needs under ``root``; repo id -> why it has none."""
    missing = build_datasets(git_dir, commit, root)
    texts = corpus(root)
    for repo_id in model_ids(test_source):
        try:
            if repo_id.endswith("/tiny-RemoteForCausalLM"):
                why = build_remote(root / "hub", repo_id, texts, git_dir, commit)
            else:
                why = build_model(root / "hub", repo_id, texts)
        except Exception as err:
            why = f"{type(err).__name__}: {str(err)[:200]}"
        if why:
            missing[repo_id] = why
    return missing


# The conftest's ``datasets.load_dataset``: local parquet for the ids built above.
LOAD_DATASET = """
import datasets as _datasets

_real_load_dataset = _datasets.load_dataset
_STANDINS = _pathlib.Path({root!r}) / "datasets"


def _load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    local = _STANDINS / str(path) / (name or "default")
    if not local.is_dir():
        return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    files = {{p.stem: str(p) for p in sorted(local.glob("*.parquet"))}}
    return _real_load_dataset("parquet", data_files=files, split=split, streaming=streaming)


_datasets.load_dataset = _load_dataset
"""
