"""Kernel times by shape, for the event truth: GEMMs, flash attention and memory-bound kernels.

Nothing here is the cost model's: the cost model charges every FLOP at one calibrated efficiency;
here a kernel's efficiency depends on its shape, from published measurements:

- **GEMM** (``gemm_efficiency``): cuBLAS bf16 on B200 reaches 1006, 1532 and 1610 TFLOPs at
  2048^3, 4096^3 and 8192^3 (pyptx.dev/performance, "Blackwell GEMM", cuBLAS column: 45%, 68%
  and 72% of its 2250 dense peak); on H100 SXM5 cuBLAS reaches 740 TFLOPs at 8192^3 (the pyptx
  Hopper GEMM example, ``examples/hopper/gemm_highperf_hopper.py``: 75% of 989). The curve's
  shape in size is B200's (relative to its 8192^3), its level H100's; between the points it is
  interpolated in log2 of the GEMM's size (the cube root of ``m n k``); below 2048 the
  efficiency falls in proportion to the size (the GPU's waves run part-empty: an assumption).
  A GEMM is then the slower of its FLOPs at that efficiency and its bytes at HBM speed (the
  roofline), which is what makes small-batch decode memory-bound.
- **Attention** (``attention_efficiency``): FlashAttention-3 forward on H100, head dim 128,
  batch x sequence = 16k tokens: 430, 517, 566, 590, 614, 621 TFLOPs at sequence 512, 1k, 2k,
  4k, 8k, 16k (pytorch/benchmark PR 2391, commit ff65cb6). Other head dims take the same curve
  (an assumption); the backward is 2.5x the forward's FLOPs at 80% of its efficiency (an
  assumption, near FlashAttention-2's reported ratio).
- **Memory-bound kernels** (norms, activations, rotary, the optimizer step): their bytes at
  ``HBM_EFFICIENCY`` of the HBM bandwidth (an assumption: STREAM-like kernels reach about 85%).

The tables are for H100-class GPUs; another cluster scales them by its own peak and bandwidth.
"""

from __future__ import annotations

import math

import numpy as np

# (size = cube root of m n k, efficiency relative to the 8192^3 GEMM): B200 cuBLAS, pyptx.dev/performance
GEMM_SHAPE = ((2048, 1006 / 1610), (4096, 1532 / 1610), (8192, 1.0))
GEMM_LEVEL = 740 / 989  # H100 SXM5 cuBLAS at 8192^3 (pyptx Hopper GEMM example), of the dense bf16 peak
# FlashAttention-3 forward, H100 SXM5, head dim 128 (pytorch/benchmark PR 2391): (sequence, TFLOPs)
FA3_H100 = ((512, 430.32), (1024, 517.10), (2048, 565.54), (4096, 590.23), (8192, 614.23), (16384, 620.73))
H100_PEAK = 989e12
ATTN_BWD_FLOPS, ATTN_BWD_EFFICIENCY = 2.5, 0.8
HBM_EFFICIENCY = 0.85
LAUNCH_S = 4e-6  # one kernel launch on the stream (an assumption: CUDA graphs hide most of it in decode)


def gemm_efficiency(m: float, n: float, k: float) -> float:
    """Share of the dense peak a bf16 GEMM of ``m x k`` by ``k x n`` reaches (see the module docstring)."""
    size = (max(m, 1.0) * max(n, 1.0) * max(k, 1.0)) ** (1 / 3)
    xs = [math.log2(s) for s, _ in GEMM_SHAPE]
    ys = [r for _, r in GEMM_SHAPE]
    if size < GEMM_SHAPE[0][0]:
        rel = ys[0] * size / GEMM_SHAPE[0][0]
    else:
        rel = float(np.interp(math.log2(size), xs, ys))
    return GEMM_LEVEL * rel


def gemm_seconds(m: float, n: float, k: float, peak: float, hbm: float, dtype_bytes: int = 2) -> float:
    """One GEMM on one GPU: the slower of its FLOPs at its shape's efficiency and its bytes
    (both operands read, the result written) at HBM speed, plus a launch."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    data = (m * k + k * n + m * n) * dtype_bytes
    return max(flops / (peak * gemm_efficiency(m, n, k)), data / (hbm * HBM_EFFICIENCY)) + LAUNCH_S


def gemms_seconds(m: np.ndarray, n: float, k: float, peak: float, hbm: float, dtype_bytes: int = 2) -> np.ndarray:
    """``gemm_seconds`` of many GEMMs that differ in ``m`` (experts at their own token counts);
    0 where ``m`` is 0."""
    m = np.asarray(m, dtype=float)
    size = (np.maximum(m, 1.0) * max(n, 1.0) * max(k, 1.0)) ** (1 / 3)
    xs = np.log2([s for s, _ in GEMM_SHAPE])
    ys = np.array([r for _, r in GEMM_SHAPE])
    rel = np.where(size < GEMM_SHAPE[0][0], ys[0] * size / GEMM_SHAPE[0][0], np.interp(np.log2(size), xs, ys))
    flops = 2.0 * m * n * k
    data = (m * k + k * n + m * n) * dtype_bytes
    t = np.maximum(flops / (peak * GEMM_LEVEL * rel), data / (hbm * HBM_EFFICIENCY)) + LAUNCH_S
    return np.where((m > 0) & (n > 0) & (k > 0), t, 0.0)


def attention_efficiency(seq: float) -> float:
    """Share of the dense peak flash attention's forward reaches at sequence length ``seq``."""
    xs = [math.log2(s) for s, _ in FA3_H100]
    ys = [t * 1e12 / H100_PEAK for _, t in FA3_H100]
    s = max(seq, 1.0)
    if s < FA3_H100[0][0]:
        return ys[0] * s / FA3_H100[0][0]
    return float(np.interp(math.log2(s), xs, ys))


def attention_seconds(
    queries: float, context: float, heads: float, head_dim: int, peak: float, *, causal: bool, backward: bool = False
) -> float:
    """Flash attention of ``queries`` tokens over ``context`` positions each (``heads`` query
    heads on this GPU): the forward, or the backward (``backward``)."""
    if queries <= 0 or heads <= 0:
        return 0.0
    flops = 4.0 * queries * context * heads * head_dim * (0.5 if causal else 1.0)
    eff = attention_efficiency(context)
    if backward:
        flops, eff = flops * ATTN_BWD_FLOPS, eff * ATTN_BWD_EFFICIENCY
    return flops / (peak * eff) + LAUNCH_S


def memory_seconds(data: float, hbm: float, kernels: int = 1) -> float:
    """A memory-bound kernel (or ``kernels`` of them) moving ``data`` bytes in all."""
    return data / (hbm * HBM_EFFICIENCY) + kernels * LAUNCH_S
