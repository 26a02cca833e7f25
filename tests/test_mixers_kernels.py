"""The kernel hand-off of flexpack.mixers, on the faked CUDA device with recording kernels.

Where fla, causal-conv1d or mamba_ssm is installed, transformers' kernel-mapped functions run the
package's kernel, and flexpack.mixers flattens the rows to one and hands the document boundaries
to the kernels' varlen keywords instead of splitting the documents. No such package is
installed here: fake ``fla`` / ``causal_conv1d`` / ``mamba_ssm`` modules stand in while a private
copy of the modeling file is imported (transformers binds the kernels at import), each recording
what reaches it (``cu_seqlens``, ``seq_idx``) and computing transformers' own torch reference per
segment. The module's output must equal each document run alone through the real torch path.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import sys
import types
from unittest import mock

import pytest
import torch
from fake_cuda import to_cpu, to_fake_cuda

import flexpack.mixers as fm
from flexpack.mixers import DocumentPlan
from flexpack.mixers._room import _function_of

transformers = pytest.importorskip("transformers")
from test_mixers import _config, _spans  # noqa: E402  (the tiny configs)

# kernel name -> (package, sequence dim of its per-token tensors, the varlen keyword it takes)
KERNELS = {
    "chunk_gated_delta_rule": ("fla", 1, "cu_seqlens"),
    "chunk_kda": ("fla", 1, "cu_seqlens"),
    "causal_conv1d_fn": ("causal_conv1d", -1, "seq_idx"),
    "mamba_chunk_scan_combined": ("mamba_ssm", 1, "seq_idx"),
    "mamba_split_conv1d_scan_combined": ("mamba_ssm", None, "seq_idx"),
}
STUBS = {  # called only when decoding with a cache: never here
    "fla": ("fused_recurrent_gated_delta_rule", "fused_recurrent_kda"),
    "causal_conv1d": ("causal_conv1d_update",),
    "mamba_ssm": ("selective_state_update", "mamba_inner_fn", "selective_scan_fn"),
}
# the torch function transformers falls back to, per kernel name, in each modeling file
TORCH_NAMES = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "chunk_kda": "chunk_kimi_delta_attention",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "mamba_chunk_scan_combined": "mamba2_chunk_scan",
    "mamba_split_conv1d_scan_combined": "mamba2_split_conv1d_scan_combined",
}


def _segments(name: str, value: torch.Tensor) -> list[tuple[int, int]]:
    value = to_cpu(value)
    if name == "cu_seqlens":
        assert value.dtype == torch.int32 and value.dim() == 1
        b = value.tolist()
        return list(itertools.pairwise(b))
    assert value.dtype == torch.int32 and value.shape[0] == 1
    ids = value[0].tolist()
    assert ids == sorted(ids)  # contiguous segments, in order
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            out.append((start, i))
            start = i
    return out


def _recorder(name: str, reference, calls: list):
    _, dim, key = KERNELS[name]
    params = list(inspect.signature(reference).parameters.values())
    params = [p for p in params if p.kind is not p.VAR_KEYWORD and p.name != key]
    params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None))

    def kernel(*args, **kwargs):
        boundary = kwargs.pop(key, None)
        calls.append((name, boundary))
        if dim is None:  # the fused training path: let the unfused kernels take over
            return None
        first = args[0]
        S = first.shape[dim]
        assert boundary is None or first.shape[0] == 1, "varlen kernels take one flattened row"

        def cut(v, a, b):
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[dim] == S:
                return v.narrow(dim % v.dim(), a, b - a)
            return v

        outs = []
        segments = [(0, S)] if boundary is None else _segments(key, boundary)
        for a, b in segments:
            out = reference(*(cut(v, a, b) for v in args),
                            **{k: cut(v, a, b) for k, v in kwargs.items()})  # fmt: skip
            outs.append(out[0] if isinstance(out, tuple) else out)
        out = torch.cat(outs, dim=dim)
        return (out, None) if name.startswith("chunk_") else out

    kernel.__signature__ = inspect.Signature(params)
    kernel.__name__ = name
    return kernel


def _twin(model_type: str, calls: list):
    """A private copy of transformers' modeling file, imported while fake kernel packages are
    installed; returns (twin module, real module)."""
    real = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    fakes = {}
    for name, (package, _, _) in KERNELS.items():
        torch_fn = getattr(real, TORCH_NAMES[name], None)
        if torch_fn is None:
            continue
        fake = fakes.setdefault(package, types.ModuleType(package))
        # 5.25 with the kernels package: the function is a module instance; its forward closes
        # over transformers' hub wrapper, which wraps the torch function
        torch_fn = _function_of(torch_fn)
        setattr(fake, name, _recorder(name, inspect.unwrap(torch_fn), calls))
    for package, names in STUBS.items():
        fake = fakes.setdefault(package, types.ModuleType(package))
        for n in names:
            if not hasattr(fake, n):
                setattr(fake, n, lambda *a, _n=n, **k: pytest.fail(f"{_n} called"))
    spec = importlib.util.spec_from_file_location(f"{real.__name__}_flexpack_twin", real.__file__)
    twin = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {**fakes, spec.name: twin}):
        spec.loader.exec_module(twin)
    return twin, real


CASES = {  # room: (model type, mixer class, the keywords its kernels must receive)
    "gated_delta_rule": ("qwen3_5", "Qwen3_5GatedDeltaNet", {"chunk_gated_delta_rule",
                                                             "causal_conv1d_fn"}),
    "kda": ("kimi_linear", "KimiLinearDeltaAttention", {"chunk_kda", "causal_conv1d_fn"}),
    "mamba2": ("bamba", "BambaMixer", {"mamba_chunk_scan_combined", "causal_conv1d_fn"}),
    "short_conv": ("lfm2", "Lfm2ShortConv", {"causal_conv1d_fn"}),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(CASES))
def test_boundaries_reach_the_kernels_varlen_arguments(kind, fake_cuda):
    model_type, cls_name, expected = CASES[kind]
    calls: list = []
    twin, real = _twin(model_type, calls)
    config = _config(kind)
    layer = 0
    torch.manual_seed(0)
    mixer = getattr(twin, cls_name)(config, layer).eval()
    plain = getattr(real, cls_name)(config, layer).eval()
    with torch.no_grad():  # torch.empty until a model's _init_weights: garbage, at times NaN
        g = torch.Generator().manual_seed(2)
        for path, p in mixer.named_parameters():
            name = path.rsplit(".", 1)[-1]
            if name in ("A_log", "dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * (0.5 if name == "dt_bias" else 2.0))
    plain.load_state_dict(mixer.state_dict())
    assert fm.uses_kernels(mixer) and not fm.uses_kernels(plain)

    doc_ids = torch.tensor([[0] * 7 + [1] * 11 + [2] * 5 + [-1] * 3, [0] * 9 + [1] * 17])
    x = torch.randn(2, 26, config.hidden_size, generator=torch.Generator().manual_seed(1))
    holder = fm.adapt(torch.nn.ModuleList([mixer]))
    to_fake_cuda(holder)
    with torch.no_grad():
        out = mixer(to_fake_cuda(x), attention_mask=None, doc_ids=to_fake_cuda(doc_ids))
    out = to_cpu(out[0] if isinstance(out, tuple) else out)
    reached = {name for name, boundary in calls if boundary is not None}
    assert expected <= reached, calls
    plan = DocumentPlan.from_doc_ids(doc_ids)
    for name, boundary in calls:
        key = KERNELS[name][2]
        want = plan.cu_seqlens if key == "cu_seqlens" else plan.seq_idx
        assert torch.equal(to_cpu(boundary), want), name
    with torch.no_grad():
        for b, a, e in _spans(doc_ids):
            alone = plain(x[b : b + 1, a:e], attention_mask=None)
            alone = alone[0] if isinstance(alone, tuple) else alone
            torch.testing.assert_close(out[b, a:e], alone[0], rtol=0, atol=1e-4)  # fp32


def test_cpu_tensors_take_the_split_path_even_with_kernels():
    """Kernels run on GPUs only: CPU rows are split into documents, no varlen keyword passed."""
    calls: list = []
    twin, _ = _twin("lfm2", calls)
    mixer = twin.Lfm2ShortConv(_config("short_conv"), 0).eval()
    fm.adapt(torch.nn.ModuleList([mixer]))
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        mixer(torch.randn(1, 6, 32), attention_mask=None, doc_ids=doc_ids)
    # up to 5.24 the kernel runs without boundaries; 5.25 sends CPU inputs to the torch path
    assert all(boundary is None for _, boundary in calls)
