"""The CuTe backend's FP8 up-proj and dH steps under a padded routing: the rows past
``offsets[E]``, which no GEMM tile writes, are zeros before a row quantization or one-pass
epilogue reads them (compute-sanitizer's initcheck found them read uninitialised). The GEMM
kernels are replaced by stand-ins that leave NaN in those rows, so this runs on any machine;
the kernels themselves are checked on the GPU (``benchmarks/stress_gpu.py``)."""

import pytest
import torch

import sonic.backend as backend
from sonic.kernels import grouped_gemm as gemm
from sonic.reference import fp8 as fp8_reference
from sonic.reference import ops as reference

E, N, D, ROWS = 4, 128, 128, 40
OFFSETS = torch.tensor([0, 8, 8, 20, 30], dtype=torch.int32)        # rows 30..39: padding


def _unwritten(cols: int, dtype=torch.float32) -> torch.Tensor:
    """An output whose expert rows hold values and whose padding rows hold NaN, as a
    varlen-M kernel leaves a fresh buffer."""
    t = torch.randn(ROWS, cols, generator=torch.Generator().manual_seed(cols), dtype=dtype)
    t[int(OFFSETS[-1]):] = float("nan")
    return t


@pytest.fixture
def recorded(monkeypatch):
    """The rows every row quantization and reference epilogue reads, recorded."""
    seen = []
    epilogue = reference.dswiglu_epilogue

    def quantize_rows(x):
        seen.append(x.clone())
        return fp8_reference.quantize_rows(x)

    def dswiglu_epilogue(da_prime, h, row_scores, gate_up):
        seen.append(da_prime.clone())
        return epilogue(da_prime, h, row_scores, gate_up)

    monkeypatch.setattr(backend, "_cute_quantize_rows", quantize_rows)
    monkeypatch.setattr(reference, "dswiglu_epilogue", dswiglu_epilogue)
    return seen


def _operands(rows_of_a: int, n: int, k: int):
    a_q = torch.zeros(rows_of_a, k, dtype=torch.float8_e4m3fn)
    b_q = torch.zeros(E, n, k, dtype=torch.float8_e4m3fn)
    return (a_q, torch.ones(k // 128, rows_of_a), b_q, torch.ones(E, n // 128, k // 128))


def _assert_padding_zero(seen):
    assert seen, "nothing was read"
    for t in seen:
        assert torch.isfinite(t[: int(OFFSETS[-1])]).all()
        assert (t[int(OFFSETS[-1]):] == 0).all()


@pytest.mark.parametrize("epilogues", ["fused", "store"])
@pytest.mark.parametrize("quantize_h", [False, True])
def test_up_proj_padding_rows_are_zeros_before_they_are_read(monkeypatch, recorded, epilogues,
                                                              quantize_h):
    gather = torch.arange(ROWS, dtype=torch.int32) % 16
    monkeypatch.setattr(gemm, "grouped_gemm_fp8_swiglu",
                        lambda *a, **k: (_unwritten(2 * N), _unwritten(N)))
    # fp32 H: the store path's SwiGLU is then the reference's, which this test can run.
    monkeypatch.setattr(backend, "_cute_grouped_mm_fp8", lambda *a, **k: _unwritten(2 * N))
    previous = backend.set_fp8_epilogues(epilogues)
    try:
        backend._cute_up_proj_swiglu_fp8(*_operands(16, 2 * N, D), OFFSETS, gather, "concat",
                                         quantize_h=quantize_h)
    finally:
        backend.set_fp8_epilogues(previous)
    _assert_padding_zero(recorded)
    assert len(recorded) == 1 + quantize_h        # A, and H for the fp8 cache


@pytest.mark.parametrize("epilogues", ["fused", "store"])
def test_dh_step_padding_rows_are_zeros_before_they_are_read(monkeypatch, recorded, epilogues):
    gather = torch.arange(ROWS, dtype=torch.int32) % 16
    h = torch.randn(ROWS, 2 * N)
    monkeypatch.setattr(gemm, "grouped_gemm_fp8_dswiglu",
                        lambda *a, **k: (_unwritten(2 * N, torch.bfloat16), _unwritten(N),
                                         torch.zeros(ROWS)))
    monkeypatch.setattr(backend, "_cute_grouped_mm_fp8", lambda *a, **k: _unwritten(N))
    previous = backend.set_fp8_epilogues(epilogues)
    try:
        backend._cute_dh_dswiglu_fp8(*_operands(16, N, D), OFFSETS, gather,
                                     h.bfloat16() if epilogues == "fused" else h,
                                     torch.rand(ROWS), "concat", quantize_dh=True)
    finally:
        backend.set_fp8_epilogues(previous)
    _assert_padding_zero(recorded)
    # fused: dH's quantization; store: the epilogue's dA', then dH's quantization
    assert len(recorded) == (1 if epilogues == "fused" else 2)
