"""fp32 activation maths shared by every kernel: the one copy of silu / swiglu / dswiglu, and
the gate functions of the other GLU variants for the grouped-GEMM epilogues.

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

The other gate functions φ of :data:`sonic.types.GATED_ACTIVATIONS` (Shazeer 2020, "GLU
Variants Improve Transformer"), as :mod:`sonic.reference.activations` defines them: GELU
(exact, ``x·Φ(x)`` through ``erf``), its tanh approximation and ReLU, each with φ′ for the
backward's ``d_gate = dA·u·φ′(g)``. :func:`gate` and :func:`gate_grad` pick φ by name at
trace time; for SwiGLU they emit exactly the instructions above.

Imports ``cutlass``: only kernel code imports this module.
"""

import cutlass
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


SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
GELU_TANH_C = 0.7978845608028654
GELU_TANH_A = 0.044715


def _phi(g, name: str):
    """``(φ(g), φ′(g))`` of an fp32 scalar for the gate functions other than SiLU."""
    if name == "geglu":
        cdf = 0.5 * (1.0 + cute.math.erf(g * SQRT_HALF))
        pdf = cute.math.exp2(g * g * (-0.5 * LOG2_E), fastmath=True) * INV_SQRT_2PI
        return g * cdf, cdf + g * pdf
    if name == "geglu_tanh":
        g2 = g * g
        t = cute.math.tanh(GELU_TANH_C * g * (1.0 + GELU_TANH_A * g2))
        return (0.5 * g * (1.0 + t),
                0.5 * (1.0 + t)
                + 0.5 * g * (1.0 - t * t) * GELU_TANH_C * (1.0 + 3.0 * GELU_TANH_A * g2))
    if name == "reglu":
        # NaN stays NaN, as torch's relu; φ′ is 0 at g = 0, as the reference's (g > 0).
        return (cute.math.max(g, Float32(0.0), propagate_nan=True),
                Float32(cutlass.select_(g > 0.0, Float32(1.0), Float32(0.0))))
    raise ValueError(f"no fused gate function for activation {name!r}")


def gate(g, name: str):
    """``φ(g)`` of an fp32 scalar for the GLU variant ``name`` (``A = φ(gate)·up``)."""
    if name == "swiglu":
        return silu(g, sigmoid(g))
    return _phi(g, name)[0]


def gate_grad(g, u, s, dap, name: str):
    """``(φ(g), d_gate)`` of fp32 scalars for the GLU variant ``name``, with
    ``dA = s·dA'`` and ``d_gate = dA·u·φ′(g)``."""
    if name == "swiglu":
        sig = sigmoid(g)
        phi = silu(g, sig)
        return phi, dswiglu_gate(s * dap, g, u, sig)
    phi, dphi = _phi(g, name)
    return phi, s * dap * u * dphi
