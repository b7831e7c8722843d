"""Helpers shared by the GPU kernel tests."""

import pytest
import torch

from sonic.kernels import kernels_available


def require_kernels() -> None:
    """Skip the calling test unless sonic's CuTe kernels can run on the current device."""
    ok, reason = kernels_available()
    if not ok:
        pytest.skip(reason)


@pytest.fixture
def fp8_kernels(monkeypatch):
    """What the FP8 grouped-GEMM tests need: the kernels on an sm_90 GPU (skip otherwise), and
    TF32 off, so the references' k-block products are exact in fp32."""
    require_kernels()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 grouped GEMM runs on sm_90a only")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def force_n_band(monkeypatch, ab_dtype: str, width: int) -> None:
    """Make the varlen-M plans of ``ab_dtype`` operands (``"bf16"``, ``"e4m3"``) walk N in
    bands of ``width`` n-groups, whatever ``heuristic.plan`` picks."""
    from sonic.kernels.grouped_gemm import heuristic

    original = heuristic.plan

    def plan(is_varlen_k, *args, **kwargs):
        tiles = original(is_varlen_k, *args, **kwargs)
        if is_varlen_k or kwargs.get("ab_dtype", "bf16") != ab_dtype:
            return tiles
        return tiles._replace(n_band=width)
    monkeypatch.setattr(heuristic, "plan", plan)


def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Fill free blocks of PyTorch's caching allocator with 0xFF bytes.

    The next output buffers are likely carved from them, so an element a kernel leaves unwritten
    reads as NaN (bf16/fp32) or -1 (int32) instead of a plausible stale value.
    """
    torch.full((nbytes,), -1, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()


def expert_counts(mode: str, num_experts: int, num_pairs: int, gen) -> torch.Tensor:
    """Rows per expert, ``(E,)`` int64 summing to ``num_pairs``: ``"one"`` gives every row to
    one expert, ``"empty"`` leaves about half the experts without rows, anything else draws
    ragged counts."""
    if mode == "one":
        counts = torch.zeros(num_experts, dtype=torch.long)
        counts[num_experts // 2] = num_pairs
        return counts
    weights = torch.rand(num_experts, generator=gen) + 0.05
    if mode == "empty":
        weights[torch.randperm(num_experts, generator=gen)[: (num_experts + 1) // 2]] = 0
    choice = torch.multinomial(weights, num_pairs, replacement=True, generator=gen)
    return torch.bincount(choice, minlength=num_experts)


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """``(E+1,)`` int32 prefix sums of ``counts`` on the GPU."""
    off = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    off[1:] = counts.cumsum(0)
    return off.cuda()


def fp8_rand(*shape, gen) -> torch.Tensor:
    """bf16 CUDA data for the FP8 tests whose rows (and, for weights, 128-blocks) differ in
    magnitude by up to ~50x, so that every block scale matters."""
    x = torch.randn(*shape, generator=gen) + 0.1
    row_gain = torch.exp(torch.randn(*shape[:-1], 1, generator=gen))
    return (x * row_gain).to(torch.bfloat16).cuda()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in the Frobenius norm, ``|out - ref| / |ref|``."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def bf16_rand(*shape, gen) -> torch.Tensor:
    """bf16 CUDA data, standard normal shifted by 0.1 (no exact zeros)."""
    return (torch.randn(*shape, generator=gen) + 0.1).to(torch.bfloat16).cuda()


def ref_varlen_m(a_rows: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 varlen-M reference: rows ``offsets[e]:offsets[e+1]`` of ``a_rows`` times
    ``b[e]ᵀ`` (``b (E, N, K)``)."""
    out = torch.empty(a_rows.shape[0], b.shape[1], dtype=torch.float32, device="cuda")
    off = offsets.tolist()
    for e in range(b.shape[0]):
        out[off[e]:off[e + 1]] = a_rows[off[e]:off[e + 1]].float() @ b[e].float().t()
    return out


def dh_problem(num_pairs: int, num_experts: int, n: int, dim_k: int, mode: str, seed: int, *,
               rand=bf16_rand):
    """Random inputs of the dH kernel, made by ``rand``: ``(offsets, w2 (E, d, n),
    dout (T, d), gather_idx (P,), h (P, 2n), scores (P,) fp32)``."""
    gen = torch.Generator().manual_seed(seed)
    offsets = expert_offsets(expert_counts(mode, num_experts, num_pairs, gen))
    w2 = rand(num_experts, dim_k, n, gen=gen)
    num_tokens = max(num_pairs // 3, 1)
    dout = rand(num_tokens, dim_k, gen=gen)
    idx = torch.randint(0, num_tokens, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
    h = rand(num_pairs, 2 * n, gen=gen)
    scores = torch.rand(num_pairs, generator=gen).cuda()
    return offsets, w2, dout, idx, h, scores


def up_proj_problem(num_pairs: int, num_experts: int, n: int, dim_k: int, mode: str,
                    seed: int):
    """Random inputs of the gathered up-proj and its fp32 H: ``(offsets, w1 (E, 2n, d),
    x (T, d), gather_idx (P,), H (P, 2n) fp32)``."""
    gen = torch.Generator().manual_seed(seed)
    offsets = expert_offsets(expert_counts(mode, num_experts, num_pairs, gen))
    w1 = bf16_rand(num_experts, 2 * n, dim_k, gen=gen)
    num_tokens = max(num_pairs // 3, 1)
    x = bf16_rand(num_tokens, dim_k, gen=gen)
    idx = torch.randint(0, num_tokens, (num_pairs,), generator=gen, dtype=torch.int32).cuda()
    return offsets, w1, x, idx, ref_varlen_m(x[idx.long()], w1, offsets)
