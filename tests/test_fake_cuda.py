"""The faked CUDA device of tests/fake_cuda.py keeps CUDA's rules: one device per op, syncs seen.

Every other CUDA rehearsal in the suite rests on this fake, so its own rules are tested against
what CUDA does: which mixed-device calls a CUDA kernel refuses (and the few it takes), and which
calls make the host wait for the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fake_cuda import (
    FakeCuda,
    FakeCudaTensor,
    HostSyncError,
    MixedDeviceError,
    to_cpu,
    to_fake_cuda,
)


def test_tensors_report_cuda_and_compute_on_cpu(fake_cuda):
    x = torch.arange(6, device="cuda").reshape(2, 3)
    assert isinstance(x, FakeCudaTensor)
    assert x.device == torch.device("cuda", 0) and x.is_cuda and not x.is_cpu
    assert x.device.type == "cuda" and x.get_device() == 0
    y = (x * 2 + 1).sum(0)
    assert y.device.type == "cuda" and torch.equal(to_cpu(y), torch.tensor([8, 12, 16]))
    assert torch.zeros_like(x).device.type == "cuda" and x.new_ones(3).device.type == "cuda"
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    assert "device='cuda:0'" in repr(x)
    with pytest.raises(TypeError, match="can't convert cuda:0"):
        x.numpy()


def test_mixed_devices_raise_where_cuda_kernels_do(fake_cuda):
    x = torch.arange(8, device="cuda")
    cpu = torch.arange(3)
    with pytest.raises(MixedDeviceError, match="cuda:0 and cpu"):
        torch.searchsorted(x, cpu)  # the bug of issue 17, block_mask.py
    with pytest.raises(MixedDeviceError):
        x[:3] + cpu
    with pytest.raises(MixedDeviceError):
        torch.cat([x, cpu])
    with pytest.raises(MixedDeviceError):
        x.index_select(0, cpu)  # index_select is not an indexing op: CUDA refuses it
    with pytest.raises(MixedDeviceError):
        torch.bitwise_and(x[:3] > 0, cpu > 0)  # dense_mask(device="cpu") on GPU doc ids


def test_what_cuda_takes_across_devices(fake_cuda):
    x = torch.arange(8, device="cuda")
    assert torch.equal(to_cpu(x + torch.tensor(2)), torch.arange(2, 10))  # a 0-d CPU scalar
    assert torch.equal(
        to_cpu(torch.where(x > 3, x, torch.tensor(0))), torch.arange(8) * (torch.arange(8) > 3)
    )
    assert torch.equal(to_cpu(x[torch.tensor([1, 5])]), torch.tensor([1, 5]))  # CPU indices
    x[torch.tensor([0])] = 7
    assert int(to_cpu(x)[0]) == 7
    y = torch.zeros(8, device="cuda")
    y.copy_(torch.ones(8))  # copies cross devices
    assert to_cpu(y).sum() == 8


def test_each_kind_of_host_sync_is_counted(fake_cuda):
    x = torch.arange(8, device="cuda")
    cases = {
        "item": lambda: x.sum().item(),
        "tolist": lambda: x.tolist(),
        "bool": lambda: bool(x.any()),
        "int": lambda: int(x.max()),
        "nonzero": lambda: x.nonzero(),
        "boolean-mask indexing": lambda: x[x > 3],
        "repeat_interleave without output_size": lambda: torch.repeat_interleave(x, x),
        "device->host copy": lambda: x.cpu(),
        "to cpu": lambda: x.to("cpu"),
        "host->device copy": lambda: torch.ones(3).to("cuda"),
        "torch.tensor on cuda": lambda: torch.tensor(2.0, device="cuda"),
        "CPU indices": lambda: x[torch.tensor([1, 2])],
        # torch 2.15 dispatches this as index_fill_ (index_put_ before): one copy either way
        "CPU indices, assigned": lambda: x.__setitem__(torch.tensor([1, 2]), 0),
        "unique": lambda: torch.unique(x),
        "masked_select": lambda: x.masked_select(x > 2),
    }
    for what, call in cases.items():
        with fake_cuda.count() as syncs:
            call()
        assert len(syncs) == 1, (what, syncs)
        assert "test_fake_cuda.py" in syncs[0].where  # the line that caused it
    assert len(fake_cuda.syncs) == len(cases)


def test_what_does_not_sync(fake_cuda):
    x = torch.arange(8, device="cuda")
    pinned = torch.ones(8).pin_memory()
    with fake_cuda.count() as syncs:
        _ = x * 2, x.cumsum(0), x.sort(), torch.searchsorted(x, x), x.max()
        _ = torch.repeat_interleave(x, x, output_size=28)
        _ = x[x.argsort()], torch.arange(3, device=x.device), x + torch.tensor(1)
        _ = pinned.to("cuda", non_blocking=True), torch.empty(3, device="cuda")
        _ = x.to(torch.float32), x.to(x.device), x.cuda()
    assert syncs == []


def test_autograd_and_modules_run_on_the_fake_device(fake_cuda):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    ref_w = lin.weight.detach().clone()
    lin.to("cuda")
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.device.type == "cuda"
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    q = lin(x).view(1, 1, 4, 8)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with fake_cuda.count() as syncs:
        out.sum().backward()
    assert syncs == [] and lin.weight.grad.device.type == "cuda" and x.grad.device.type == "cuda"
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.device.type == "cuda"
    lin.to("cpu")
    assert type(lin.weight.data) is torch.Tensor and lin.weight.device.type == "cpu"
    torch.testing.assert_close(lin.weight.float(), ref_w, atol=1e-2, rtol=1e-2)


def test_error_mode_raises_at_the_first_sync():
    with FakeCuda(syncs="error"):
        x = torch.arange(4, device="cuda")
        with pytest.raises(HostSyncError, match="item"):
            x.sum().item()


def test_the_context_undoes_its_patches():
    real_to, real_tensor = torch.Tensor.to, torch.tensor
    with FakeCuda():
        t = to_fake_cuda(torch.ones(2))
        assert t.device.type == "cuda"
    assert torch.Tensor.to is real_to and torch.tensor is real_tensor
    assert not torch.cuda.is_available()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
