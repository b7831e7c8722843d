"""The FP8 kernels' division (``sonic.kernels.fp8_quant``'s ``quotient``): Markstein's
sequence from one reciprocal, emulated on the CPU, against IEEE fp32 division.

The kernels compute ``x / scale`` as ``q = RN(x·y)`` with ``y = RN(1/scale)``, then two
corrections ``q = fma(-fma(scale, q, -x), y, q)``, which keep a zero ``x``'s sign. Here every
fma is emulated in float64 (a product of two fp32 values is exact there) and rounded once to
fp32; the GPU tests compare the kernels themselves with the reference bitwise.
"""

import numpy as np
import torch

from sonic.kernels import fp8_quant


def _fma32(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _quotient(x, scale):
    y = (np.float32(1.0) / scale).astype(np.float32)
    q = (x * y).astype(np.float32)
    for _ in range(2):
        q = _fma32(-_fma32(scale, q, -x), y, q)
    return q


def test_quotient_is_the_ieee_division_on_the_recipes_operands():
    gen = torch.Generator().manual_seed(0)
    n = 1 << 22
    # bf16 values (what the kernels quantize) and scales amax / 448 over 40 binades, both
    # signs, with zeros of both signs among the values.
    x = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen)))
    x = x.to(torch.bfloat16).float()
    x[::97] = 0.0
    x[1::97] = -0.0
    amax = torch.where(x == 0, 1.0, x.abs()) * (1 + torch.rand(n, generator=gen) * 3)
    scale = (amax / 448.0).numpy()
    # Scales whose significands are all ones or nearly (the hardest reciprocals).
    hard = np.float32(2.0) - np.float32(2.0 ** -23) * np.arange(1, 9, dtype=np.float32)
    scale[: n // 16] = np.resize(hard, n // 16) * np.exp2(
        np.resize(np.arange(-30, 30, dtype=np.float32), n // 16))
    x = x.numpy()
    x[: n // 16] = np.minimum(np.abs(x[: n // 16]), scale[: n // 16] * 448) * np.sign(
        x[: n // 16]) + 0.0 * x[: n // 16]
    fast = (scale >= fp8_quant.FAST_SCALE_MIN) & (scale <= fp8_quant.FAST_SCALE_MAX)
    assert fast.all()
    want = x / scale
    got = _quotient(x, scale)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
