"""fp32 SwiGLU maths shared by every kernel: the one copy of silu / swiglu / dswiglu.

docs/design.md §1 and §3 (SonicMoE arXiv 2512.14080 App. C): ``a = silu(g)·u`` with
``silu(g) = g·σ(g)``; backward with ``dA = s·dA'``: ``d_gate = dA·u·σ(g)·(1 + g(1 − σ(g)))``,
``d_up = dA·silu(g)``. Used inside ``@cute.jit`` code by the one-pass SwiGLU kernels
(:mod:`sonic.kernels.swiglu`, on 8-element fp32 vectors) and the grouped-GEMM epilogues
(:mod:`sonic.kernels.grouped_gemm.epilogue`, on fp32 scalars): the functions are traced inline,
so they cost nothing beyond the instructions they emit.

``σ(g) = 1 / (1 + 2^(−g·log2 e))`` with the MUFU ``ex2`` and ``rcp`` approximations (≤ 2 ulp
each, within ~1e-6 relative of the IEEE functions). The IEEE ``exp`` and division would nearly
double the one-pass backward's instructions (n = 1024 SASS: 1573 against 885 per thread) and
raise its registers from 79 to 98, i.e. fewer warps in flight to cover DRAM latency.

Imports ``cutlass``: only kernel code imports this module.
"""

from cutlass import Float32, cute

LOG2_E = 1.4426950408889634


def sigmoid(g):
    """``σ(g)`` of an fp32 scalar."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(g * -LOG2_E, fastmath=True))


def sigmoid_vec(g, width: int):
    """``σ(g)`` of an fp32 vector (``TensorSSA``) of ``width`` elements: ``ex2`` on the vector,
    ``rcp`` per element (the approximate reciprocal has no vector form)."""
    den = cute.make_rmem_tensor((width,), Float32)
    den.store(1.0 + cute.math.exp2(g * -LOG2_E, fastmath=True))
    for j in range(width):
        den[j] = cute.arch.rcp_approx(den[j])
    return den.load()


def silu(g, sig):
    """``silu(g) = g·σ(g)``, given ``sig = σ(g)`` (scalars or vectors)."""
    return g * sig


def dswiglu_gate(da, g, u, sig):
    """``d_gate = dA·u·σ(g)·(1 + g(1 − σ(g)))``, given ``sig = σ(g)`` (scalars or vectors)."""
    return da * u * sig * (1.0 + g * (1.0 - sig))
