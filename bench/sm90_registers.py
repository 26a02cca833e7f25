"""Registers and spills of flex's backward at head dim 256 on sm_90, without a GPU.

Triton compiles for a ``GPUTarget`` with no device present, and the ptxas its package carries
reports registers and spills (``-v``). Inductor's own flex backward kernel cannot be generated
without a GPU (its fake CUDA tensors initialise a CUDA context), so this compiles a model of its
dK/dV loop instead: the k, v tiles and the dK, dV accumulators of BLOCK_N1 x D held across a
loop over BLOCK_M1-row query blocks with the same four dots (q k^T, p^T do, v do^T, ds^T q),
causal masking and exp2. It rehearses the register pressure of each block configuration; it
is not the real kernel (that one also carries the mask_mod, the block-sparse indices and the
dQ half), so read its spills as a lower bound.

Usage (the torch 2.11 venv has triton 3.6, the GPU image's): python bench/sm90_registers.py
Needs triton with the NVIDIA backend (Linux x86_64 wheels carry ptxas); ~1 minute on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, S,
    D: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N1
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, D)
    k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])  # (BLOCK_N1, D)
    v = tl.load(V + offs_n[:, None] * D + offs_d[None, :])
    dk = tl.zeros([BLOCK_N1, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, D], dtype=tl.float32)
    for start_m in range(0, S, BLOCK_M1):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        qT = tl.load(Q + offs_m[None, :] * D + offs_d[:, None])  # (D, BLOCK_M1)
        do = tl.load(DO + offs_m[:, None] * D + offs_d[None, :])  # (BLOCK_M1, D)
        lse = tl.load(LSE + offs_m)
        delta = tl.load(DELTA + offs_m)
        pT = tl.math.exp2(tl.dot(k, qT) - lse[None, :])  # (BLOCK_N1, BLOCK_M1)
        pT = tl.where(offs_n[:, None] <= offs_m[None, :], pT, 0.0)
        dv += tl.dot(pT.to(tl.bfloat16), do)
        dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(dsT.to(tl.bfloat16), tl.trans(qT))
    tl.store(DK + offs_n[:, None] * D + offs_d[None, :], dk.to(tl.bfloat16))
    tl.store(DV + offs_n[:, None] * D + offs_d[None, :], dv.to(tl.bfloat16))


# (D, BLOCK_M1, BLOCK_N1, num_warps, num_stages, label)
CONFIGS = [
    (128, 64, 128, 8, 3, "D=128, torch 2.11-2.13 sm90 default (64/128/128/64, 3 stages, 8 warps)"),
    (256, 64, 64, 4, 2, "D=256, torch 2.11-2.13 sm90 default (64 blocks, 2 stages, 4 warps)"),
    (256, 32, 32, 8, 1, "D=256, flexpack WIDE_HEAD_BWD_OPTIONS (32 blocks, 1 stage, 8 warps)"),
    (256, 32, 32, 4, 1, "D=256, 32 blocks, 1 stage, 4 warps"),
    (256, 32, 64, 8, 1, "D=256, BLOCK_M1 32 / BLOCK_N1 64, 1 stage, 8 warps"),
]


def main() -> None:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    sig = {n: "*bf16" for n in ("Q", "K", "V", "DO", "DK", "DV")}
    sig.update(LSE="*fp32", DELTA="*fp32", S="i32")
    sig.update(D="constexpr", BLOCK_M1="constexpr", BLOCK_N1="constexpr")
    print(f"triton {triton.__version__}, target sm_90 (ptxas -arch=sm_90a -v)")
    print("| configuration | registers | spill stores | stack |\n|---|---:|---:|---:|")
    for D, m1, n1, warps, stages, label in CONFIGS:
        src = ASTSource(fn=dkdv, signature=sig, constexprs={"D": D, "BLOCK_M1": m1, "BLOCK_N1": n1})
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
        os.unlink(f.name)
        regs = spills = stack = "?"
        for line in report.splitlines():
            if "Used" in line and "registers" in line:
                regs = line.split("Used ")[1].split(" registers")[0]
            if "spill stores" in line:
                stack = line.split("info    :")[-1].strip().split(" bytes stack frame")[0]
                spills = line.split("bytes stack frame, ")[1].split(" bytes spill stores")[0]
        print(f"| {label} | {regs} | {spills} B | {stack} B |")


if __name__ == "__main__":
    main()
