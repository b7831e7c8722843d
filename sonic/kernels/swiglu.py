"""SwiGLU and its backward epilogue on the GPU, each in one bandwidth-bound pass.

DESIGN §3 (forward step 1 epilogue, backward step 1 epilogue; SonicMoE arXiv 2512.14080 App. C):
until the grouped GEMMs fuse them, these standalone kernels replace the PyTorch reference
(:func:`sonic.reference.ops.swiglu`, :func:`sonic.reference.ops.dswiglu_epilogue`), which builds
several ``(P, n)`` fp32 temporaries, by one read of the inputs and one write of the outputs.

One warp owns one row of ``H (P, 2n)``; each lane walks 8-column slices ``lane, lane+32, ...``
of the row's ``n`` output columns. A slice's 8 gate and 8 up values are two 16-byte loads of
``H`` — the two halves of the row (``"concat"``) or 16 consecutive elements alternating gate, up
(``"interleaved"``) — held in a ``(2, 8)`` register fragment whose mode 0 picks gate or up, so
the same arithmetic serves both layouts. Math is fp32 (:mod:`sonic.kernels.activation`, shared
with the grouped-GEMM epilogues: ``σ`` from the hardware ``ex2`` and ``rcp`` approximations,
within ~1e-6 relative of the IEEE functions); each bf16 output is rounded once.
The backward's ``ds = ⟨dA', A⟩`` is summed by each lane over its slices in slice order, then
across the warp by a butterfly shuffle with fixed offsets: the order is fixed, no atomics, so
``ds`` is bitwise deterministic. Neighbouring lanes touch neighbouring 16-byte slices, so every
row is read and written in full coalesced lines.
"""

import functools

import torch

from sonic.kernels import runtime
from sonic.kernels.registry import KernelVariant, register
from sonic.types import GATE_UP_LAYOUTS

# Output columns per lane and slice: one 16-byte bf16 vector.
VEC = 8
# FP8 scale blocks of A (the recipe's 1x128) and the lanes that cover one.
FP8_BLOCK = 128
LANES_PER_BLOCK = FP8_BLOCK // VEC
WARP = 32
# Rows per block (one warp each): 256 threads, enough blocks per SM to hide DRAM latency.
WARPS = 8


@functools.cache
def _kernels():
    """Build the CuTe-DSL kernel class (imports cutlass, so only on first use)."""
    import cutlass
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, cute
    from cuda.bindings import driver as cuda

    from sonic.kernels import activation
    from sonic.kernels.fp8_quant import device_helpers

    fp8 = device_helpers()

    class SwigluKernel:
        """One static configuration: ``n``, gate/up layout, forward (SwiGLU) or backward
        epilogue, for the forward whether A is written quantized, and with it whether H is
        also written quantized (the FP8 activation cache); for the backward whether H is read
        in e4m3 (``h_fp8``: that cache, dequantized per slice as it is loaded, with its 1×128
        scales at ``h_scales``).

        Both directions share one launch signature; the forward never reads ``da_prime`` and
        ``row_scores`` nor writes ``dh``; it writes A to ``a`` (bf16, or with ``quantize``
        e4m3) and, quantized, A's scales to ``ds``'s address. With ``quantize``, the backward
        also writes dH in e4m3 to ``dh_q`` and its 1×128 scales to ``dh_scales``, and the
        forward with ``quantize_h`` writes H there; the others never touch those two. Only
        ``h_fp8`` reads ``h_scales``.
        """

        def __init__(self, n: int, gate_up: str, backward: bool, quantize: bool = False,
                     quantize_h: bool = False, h_fp8: bool = False):
            self.n = n
            self.backward = backward
            self.quantize = quantize
            self.quantize_h = quantize_h
            self.h_fp8 = h_fp8
            self.slices = n // VEC
            self.iters = (self.slices + WARP - 1) // WARP
            if gate_up == "concat":
                # gate at column c, up at column n + c
                self.h_stride, self.h_scale = (n, 1), 1
                self.frag_layout = ((2, VEC), (VEC, 1))
            else:
                # gate at column 2c, up at 2c + 1: one slice is 16 consecutive elements
                self.h_stride, self.h_scale = (1, 2), 2
                self.frag_layout = ((2, VEC), (1, 2))

        @cute.jit
        def __call__(self, h: Int64, da_prime: Int64, row_scores: Int64, a: Int64, dh: Int64,
                     ds: Int64, dh_q: Int64, dh_scales: Int64, h_scales: Int64,
                     num_rows: Int32, stream: cuda.CUstream):
            blocks = (num_rows + WARPS - 1) // WARPS
            gmem = runtime.gmem_ptr
            a_ptr = gmem(BFloat16, a, 16)
            if cutlass.const_expr(self.quantize and not self.backward):
                a_ptr = gmem(Float8E4M3FN, a, 8)
            h_ptr = gmem(BFloat16, h, 16)
            if cutlass.const_expr(self.h_fp8):
                h_ptr = gmem(Float8E4M3FN, h, 8)
            self.kernel(h_ptr, gmem(BFloat16, da_prime, 16),
                        gmem(Float32, row_scores, 4), a_ptr,
                        gmem(BFloat16, dh, 16), gmem(Float32, ds, 4),
                        gmem(Float8E4M3FN, dh_q, 8), gmem(Float32, dh_scales, 4),
                        gmem(Float32, h_scales, 4), num_rows).launch(
                grid=[blocks, 1, 1], block=[WARPS * WARP, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, h: cute.Pointer, da_prime: cute.Pointer, row_scores: cute.Pointer,
                   a: cute.Pointer, dh: cute.Pointer, ds: cute.Pointer, dh_q: cute.Pointer,
                   dh_scales: cute.Pointer, h_scales: cute.Pointer, num_rows: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % WARP
            row = bidx * WARPS + tidx // WARP
            # The whole warp shares `row`, so the shuffles below run with every lane active.
            if row < num_rows:
                # 64-bit row offsets: P·2n exceeds 2**31 elements at large P.
                r64 = Int64(row)
                h_row = h + r64 * (2 * self.n)
                out_row = r64 * self.n
                h_layout = cute.make_layout((2, VEC), stride=self.h_stride)
                frag_layout = cute.make_layout(self.frag_layout[0], stride=self.frag_layout[1])
                h_frags = [cute.make_rmem_tensor(frag_layout, BFloat16) for _ in range(self.iters)]
                loaded = h_frags
                if cutlass.const_expr(self.h_fp8):
                    loaded = [cute.make_rmem_tensor(frag_layout, Float8E4M3FN)
                              for _ in range(self.iters)]
                dap_frags = [cute.make_rmem_tensor((VEC,), BFloat16) if self.backward else None
                             for _ in range(self.iters)]
                # All loads of the row are issued before any store: the compiler cannot move a
                # load above a store that may alias it, so this is what keeps them in flight.
                for i in cutlass.range_constexpr(self.iters):
                    col = (lane + i * WARP) * VEC
                    # Only the last pass can run past the row, and only when 32·8 ∤ n.
                    frags = (loaded[i], dap_frags[i])
                    if cutlass.const_expr((i + 1) * WARP <= self.slices):
                        self._load(h_row, da_prime, out_row, col, h_layout, *frags)
                    elif col < self.n:
                        self._load(h_row, da_prime, out_row, col, h_layout, *frags)
                if cutlass.const_expr(self.h_fp8):
                    self._dequantize(h_scales, row, num_rows, lane, loaded, h_frags)
                partial = Float32(0.0)
                score = Float32(0.0)
                if cutlass.const_expr(self.backward):
                    score = cute.make_tensor(row_scores, cute.make_layout(num_rows))[row]
                if cutlass.const_expr(self.quantize and not self.backward):
                    self._finish_quantized(a, ds, dh_q, dh_scales, row, num_rows, out_row, lane,
                                           h_layout, h_frags)
                if cutlass.const_expr(self.quantize and self.backward):
                    partial = self._finish_dh_quantized(a, dh, dh_q, dh_scales, row, num_rows,
                                                        out_row, lane, score, h_layout, h_frags,
                                                        dap_frags)
                for i in cutlass.range_constexpr(0 if self.quantize else self.iters):
                    col = (lane + i * WARP) * VEC
                    frags = (h_frags[i], dap_frags[i])
                    if cutlass.const_expr((i + 1) * WARP <= self.slices):
                        partial = self._finish(a, dh, out_row, col, score, partial, h_layout,
                                               *frags)
                    elif col < self.n:
                        partial = self._finish(a, dh, out_row, col, score, partial, h_layout,
                                               *frags)
                if cutlass.const_expr(self.backward):
                    for k in cutlass.range_constexpr(5):
                        partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=16 >> k)
                    if lane == 0:
                        cute.make_tensor(ds, cute.make_layout(num_rows))[row] = partial

        @cute.jit
        def _finish_quantized(self, q: cute.Pointer, scales: cute.Pointer, h_q: cute.Pointer,
                              h_scales: cute.Pointer, row: Int32, num_rows: Int32,
                              out_row: Int64, lane: Int32, h_layout: cute.Layout,
                              h_frags: list):
            """Forward with A quantized: per 8-column slice, A rounded to bf16 (the values
            :func:`sonic.kernels.fp8_quant.quantize_rows` would read), the amax of each
            128-column block over its 16 lanes (every lane shuffles, those past ``n`` with 0),
            then ``q`` and, from the block's first lane, its scale at ``scales[block, row]``.
            With ``quantize_h``, the loaded H as well (:meth:`_store_quantized_h`)."""
            for i in cutlass.range_constexpr(self.iters):
                col = (lane + i * WARP) * VEC
                vals = cute.make_rmem_tensor((VEC,), Float32)
                h_vals = cute.make_rmem_tensor((2, VEC), Float32)
                amax = Float32(0.0)
                amax_g, amax_u = Float32(0.0), Float32(0.0)
                if cutlass.const_expr((i + 1) * WARP <= self.slices):
                    amax = self._rounded_act(h_frags[i], vals)
                    if cutlass.const_expr(self.quantize_h):
                        amax_g, amax_u = self._pair_values(h_frags[i], h_vals)
                elif col < self.n:
                    amax = self._rounded_act(h_frags[i], vals)
                    if cutlass.const_expr(self.quantize_h):
                        amax_g, amax_u = self._pair_values(h_frags[i], h_vals)
                scale = fp8.scale_of(fp8.butterfly_max(amax, LANES_PER_BLOCK))
                if col < self.n:
                    fp8.quantize_store(vals, scale, cute.make_tensor(q + (out_row + col),
                                                                      cute.make_layout(VEC)))
                    if lane % LANES_PER_BLOCK == 0:
                        block = Int64(col // FP8_BLOCK)
                        cute.make_tensor(scales + block * num_rows.to(Int64),
                                         cute.make_layout(num_rows))[row] = scale
                if cutlass.const_expr(self.quantize_h):
                    self._store_quantized_h(h_q, h_scales, row, num_rows, out_row, lane, col,
                                            h_layout, h_frags[i].layout, h_vals, amax_g,
                                            amax_u)

        @cute.jit
        def _dequantize(self, scales: cute.Pointer, row: Int32, num_rows: Int32, lane: Int32,
                        q_frags: list, h_frags: list):
            """``h_frags`` = the loaded e4m3 slices times their 1×128 blocks' scales, rounded to
            bf16: bitwise :func:`sonic.kernels.fp8_quant.dequantize_rows`. After all loads
            are issued, so they stay in flight. A lane past ``n`` reads no scale (its values
            are never stored)."""
            per_row = scales + Int64(row)
            for i in cutlass.range_constexpr(self.iters):
                col = (lane + i * WARP) * VEC
                scale_g, scale_u = Float32(1.0), Float32(1.0)
                if col < self.n:
                    gate_block = Int64(col * self.h_scale // FP8_BLOCK)
                    up_block = gate_block
                    if cutlass.const_expr(self.h_scale == 1):    # concat: up at n + col
                        up_block = Int64((self.n + col) // FP8_BLOCK)
                    scale_g = cute.make_tensor(per_row + gate_block * num_rows.to(Int64),
                                               cute.make_layout(1))[0]
                    scale_u = cute.make_tensor(per_row + up_block * num_rows.to(Int64),
                                               cute.make_layout(1))[0]
                for half, scale in ((0, scale_g), (1, scale_u)):
                    h_frags[i][half, None].store(
                        (q_frags[i][half, None].load().to(Float32) * scale).to(BFloat16))

        def _pair_values(self, frag, vals):
            """``vals`` = a ``(2, 8)`` slice's gate and up values (H or dH) as fp32; returns
            their amaxes. Traced inline."""
            amaxes = []
            for half in range(2):
                vals[half, None].store(frag[half, None].load().to(Float32))
                amaxes.append(fp8.slice_amax(vals[half, None]))
            return amaxes[0], amaxes[1]

        @cute.jit
        def _store_quantized_h(self, q: cute.Pointer, scales: cute.Pointer, row: Int32,
                               num_rows: Int32, out_row: Int64, lane: Int32, col: Int32,
                               h_layout: cute.Layout, frag_layout: cute.Layout,
                               vals: cute.Tensor, amax_g: Float32, amax_u: Float32):
            """One slice of a ``(P, 2n)`` tensor in H's layout (dH, or H itself), its fp32
            gate and up values in ``vals``, stored in e4m3 per 1×128 block of the row:
            "concat": the gate and the up values of a slice lie in two blocks, each spanning
            16 lanes; "interleaved": a slice is 16 consecutive columns, a block spans 8
            lanes. The block amaxes are reduced by shuffles in which every lane takes part
            (those past ``n`` with 0); then the e4m3 values and, from each block's first
            lane, its scale at ``scales[block, row]``."""
            concat = self.h_scale == 1
            lanes = LANES_PER_BLOCK if concat else LANES_PER_BLOCK // 2
            if cutlass.const_expr(not concat):     # one block holds both halves
                amax_g = cute.arch.fmax(amax_g, amax_u, nan=True)
            scale_g = fp8.scale_of(fp8.butterfly_max(amax_g, lanes))
            scale_u = scale_g
            if cutlass.const_expr(concat):
                scale_u = fp8.scale_of(fp8.butterfly_max(amax_u, lanes))
            if col < self.n:
                q_frag = cute.make_rmem_tensor(frag_layout, Float8E4M3FN)
                q_frag[0, None].store(fp8.quantize(vals[0, None], scale_g).load())
                q_frag[1, None].store(fp8.quantize(vals[1, None], scale_u).load())
                cute.autovec_copy(q_frag, cute.make_tensor(
                    q + (out_row * 2 + col * self.h_scale), h_layout))
                per_row = scales + Int64(row)
                if lane % lanes == 0:
                    first = Int64(col * self.h_scale // FP8_BLOCK)
                    cute.make_tensor(per_row + first * num_rows.to(Int64),
                                     cute.make_layout(1))[0] = scale_g
                    if cutlass.const_expr(concat):
                        up = first + self.n // FP8_BLOCK
                        cute.make_tensor(per_row + up * num_rows.to(Int64),
                                         cute.make_layout(1))[0] = scale_u

        @cute.jit
        def _finish_dh_quantized(self, a: cute.Pointer, dh: cute.Pointer, q: cute.Pointer,
                                 scales: cute.Pointer, row: Int32, num_rows: Int32,
                                 out_row: Int64, lane: Int32, score: Float32,
                                 h_layout: cute.Layout, h_frags: list, dap_frags: list):
            """Backward with dH also in e4m3 (the dX GEMM's operand): per slice, what
            :meth:`_finish` stores, then the bf16 dH values it stored in e4m3 per 1×128 block
            (:meth:`_store_quantized_h`). Returns ``Σ dA'·A`` over this lane's slices."""
            partial = Float32(0.0)
            for i in cutlass.range_constexpr(self.iters):
                col = (lane + i * WARP) * VEC
                vals = cute.make_rmem_tensor((2, VEC), Float32)
                amax_g, amax_u = Float32(0.0), Float32(0.0)
                if cutlass.const_expr((i + 1) * WARP <= self.slices):
                    partial, amax_g, amax_u = self._finish(a, dh, out_row, col, score, partial,
                                                           h_layout, h_frags[i], dap_frags[i],
                                                           vals)
                elif col < self.n:
                    partial, amax_g, amax_u = self._finish(a, dh, out_row, col, score, partial,
                                                           h_layout, h_frags[i], dap_frags[i],
                                                           vals)
                self._store_quantized_h(q, scales, row, num_rows, out_row, lane, col, h_layout,
                                        h_frags[i].layout, vals, amax_g, amax_u)
            return partial

        def _rounded_act(self, h_frag, vals):
            """``vals`` = SwiGLU of the loaded slice rounded to bf16 (as fp32); returns the
            slice's amax. Traced inline."""
            g = h_frag[0, None].load().to(Float32)
            u = h_frag[1, None].load().to(Float32)
            act = activation.silu(g, activation.sigmoid_vec(g, VEC)) * u
            vals.store(act.to(BFloat16).to(Float32))
            return fp8.slice_amax(vals)

        def _load(self, h_row, da_prime, out_row, col, h_layout, h_frag, dap_frag):
            """Load one 8-column slice of the row: gate and up of ``H``, and ``dA'`` (backward).

            Traced inline (plain Python, no control flow of its own)."""
            cute.autovec_copy(cute.make_tensor(h_row + col * self.h_scale, h_layout), h_frag)
            if self.backward:
                dap_src = cute.make_tensor(da_prime + (out_row + col), cute.make_layout(VEC))
                cute.autovec_copy(dap_src, dap_frag)

        def _finish(self, a, dh, out_row, col, score, partial, h_layout, h_frag, dap_frag,
                    dh_vals=None):
            """Compute and store one loaded slice; return ``partial + Σ dA'·A`` over the slice
            (backward) or ``partial`` unchanged (forward). With ``dh_vals`` (a ``(2, 8)`` fp32
            fragment, backward), also the stored bf16 dH values there (gate, up) and their
            amaxes: ``(partial, amax gate, amax up)``. Traced inline, like :meth:`_load`."""
            g = h_frag[0, None].load().to(Float32)
            u = h_frag[1, None].load().to(Float32)
            sig = activation.sigmoid_vec(g, VEC)
            silu = activation.silu(g, sig)
            act = silu * u
            a_frag = cute.make_rmem_tensor((VEC,), BFloat16)
            if self.backward:
                dap = dap_frag.load().to(Float32)
                partial = partial + (dap * act).reduce(cute.ReductionOp.ADD, 0.0, 0)
                da = dap * score
                dh_frag = cute.make_rmem_tensor(h_frag.layout, BFloat16)
                dh_frag[0, None].store(activation.dswiglu_gate(da, g, u, sig).to(BFloat16))
                dh_frag[1, None].store((da * silu).to(BFloat16))
                cute.autovec_copy(dh_frag, cute.make_tensor(dh + (out_row * 2 + col * self.h_scale),
                                                            h_layout))
                a_frag.store((act * score).to(BFloat16))
            else:
                a_frag.store(act.to(BFloat16))
            cute.autovec_copy(a_frag, cute.make_tensor(a + (out_row + col), cute.make_layout(VEC)))
            if dh_vals is None:
                return partial
            return partial, *self._pair_values(dh_frag, dh_vals)

    return SwigluKernel


def _compile(n: int, gate_up: str, backward: bool, keep_ptx: bool = False,
             quantize: bool = False, quantize_h: bool = False, h_fp8: bool = False):
    """Compile one static configuration with placeholder arguments."""
    import cutlass

    addresses = [runtime.fake_address() for _ in range(9)]
    return runtime.compile_launcher(_kernels()(n, gate_up, backward, quantize, quantize_h,
                                               h_fp8),
                                    *addresses,
                                    cutlass.Int32(1), keep_ptx=keep_ptx)


def _check_h(h: torch.Tensor, gate_up: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Validate ``h`` and ``gate_up``; return ``n``."""
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up must be one of {GATE_UP_LAYOUTS}, got {gate_up!r}")
    runtime.check_tensor("h", h, dtypes=(dtype,), ndim=2)
    if h.shape[1] % (2 * VEC):
        raise ValueError(f"h's last dimension 2n must have n a multiple of {VEC}, "
                         f"got 2n = {h.shape[1]}")
    return h.shape[1] // 2


def _output(name: str, out: torch.Tensor | None, like: torch.Tensor,
            others: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``out`` checked to be a buffer for ``like``'s values — ``like`` itself, or disjoint
    from it and from ``others`` — or a new one."""
    if out is None:
        return torch.empty_like(like)
    runtime.check_tensor(name, out, dtypes=(torch.bfloat16,), ndim=2, device=like.device)
    if out.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if any(runtime.overlaps(out, t) for t in others) or (
            out.data_ptr() != like.data_ptr() and runtime.overlaps(out, like)):
        raise ValueError(f"{name} must be the input it replaces or a buffer overlapping no "
                         "input: a partial overlap would overwrite elements other lanes still "
                         "read")
    return out


def swiglu(h: torch.Tensor, gate_up: str = "concat", *, quantize: bool = False,
           quantize_h: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """SwiGLU activation ``A = silu(gate) ⊙ up`` of ``H`` (DESIGN §3; SonicMoE App. C).

    Same function as :func:`sonic.reference.ops.swiglu`: fp32 math, one rounding to bf16
    (``σ`` within ~1e-6 relative of the reference's, see the module notes).

    With ``quantize``, A is written as the FP8 path's down-proj reads it (issue 18:
    quantization where the data is produced): e4m3 with one fp32 scale per 1×128 slice of
    each row, bitwise ``sonic.kernels.fp8_quant.quantize_rows(swiglu(h))`` (the bf16-rounded
    A is quantized) without writing and reading A in bf16: the FP8 layer's default
    (:func:`sonic.backend.set_fp8_epilogues`). With ``quantize_h`` as well, H itself is also
    written in e4m3 per 1×128 slice, bitwise ``quantize_rows(h)``: the FP8 activation cache
    (``activation_cache="fp8"``) made in the same read of H.

    Args:
        h: ``(P, 2n)`` bf16, contiguous, CUDA, 16-byte aligned; ``n`` a multiple of 8 (of
            128 with ``quantize``).
        gate_up: ``"concat"`` (gate = columns ``[0, n)``, up = ``[n, 2n)``) or
            ``"interleaved"`` (gate = even columns, up = odd columns).
        quantize: return A in e4m3 with its scales instead of bf16.
        quantize_h: with ``quantize``, also return H in e4m3 with its scales.

    Returns:
        ``A (P, n)`` bf16; with ``quantize``, ``(q (P, n) float8_e4m3fn, scales (n/128, P)
        fp32)``, with ``quantize_h`` followed by ``(h_q (P, 2n) float8_e4m3fn, h_scales
        (2n/128, P) fp32)``. ``P = 0`` returns empty tensors without a launch.

    Raises:
        TypeError: ``h`` is not a bf16 tensor.
        ValueError: ``h`` is not a contiguous 2-D CUDA tensor, ``n`` is not a multiple of 8
            (of 128 with ``quantize``), ``h`` is not 16-byte aligned, ``gate_up`` is
            unknown, or ``quantize_h`` without ``quantize``.
    """
    n = _check_h(h, gate_up)
    if quantize_h and not quantize:
        raise ValueError("swiglu(quantize_h=True) needs quantize=True (H is quantized in the "
                         "FP8 path's pass, which writes A in e4m3)")
    if quantize:
        return _swiglu_quantized(h, gate_up, n, quantize_h)
    num_rows = h.shape[0]
    a = torch.empty(num_rows, n, dtype=h.dtype, device=h.device)
    if num_rows == 0 or n == 0:
        return a
    fn = runtime.compiled(("swiglu", n, gate_up), lambda: _compile(n, gate_up, False))
    ha, aa = runtime.address(h, 16), runtime.address(a, 16)
    # The forward never touches the backward-only addresses; h's stands in for them.
    fn(ha, ha, ha, aa, ha, ha, ha, ha, ha, num_rows)
    return a


def _quantized_like(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 ``(rows, cols)`` and its ``(cols/128, rows)`` fp32 scales."""
    return (torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(cols // FP8_BLOCK, rows, dtype=torch.float32, device=device))


def _swiglu_quantized(h: torch.Tensor, gate_up: str, n: int, quantize_h: bool):
    if n % FP8_BLOCK:
        raise ValueError(f"swiglu(quantize=True) needs n a multiple of {FP8_BLOCK} (whole 1x"
                         f"{FP8_BLOCK} scale slices), got n = {n}")
    num_rows = h.shape[0]
    out = _quantized_like(num_rows, n, h.device)
    if quantize_h:
        out += _quantized_like(num_rows, 2 * n, h.device)
    if num_rows == 0 or n == 0:
        return out
    fn = runtime.compiled(("swiglu_quantized", n, gate_up, quantize_h),
                          lambda: _compile(n, gate_up, False, quantize=True,
                                           quantize_h=quantize_h))
    adr = runtime.address
    ha = adr(h, 16)
    # The forward never touches the backward-only addresses; h's stands in for them (and for
    # H's e4m3 copy without quantize_h).
    h_q = (adr(out[2], 16), adr(out[3], 4)) if quantize_h else (ha, ha)
    fn(ha, ha, ha, adr(out[0], 16), ha, adr(out[1], 4), *h_q, ha, num_rows)
    return out


def dswiglu_epilogue(da_prime: torch.Tensor, h: torch.Tensor, row_scores: torch.Tensor,
                     gate_up: str = "concat", *, h_scales: torch.Tensor | None = None,
                     dh_out: torch.Tensor | None = None, a_out: torch.Tensor | None = None,
                     quantize_dh: bool = False) -> tuple[torch.Tensor, ...]:
    """Backward epilogue of the dH step (DESIGN §3, backward step 1; SonicMoE App. C).

    Same function as :func:`sonic.reference.ops.dswiglu_epilogue`: per row, with ``g, u`` from
    ``h``, ``σ = sigmoid(g)``, ``A = g·σ·u`` (fp32, never rounded) and ``dA = s·dA'``:
    ``dH = merge(dA·u·σ·(1 + g(1 − σ)), dA·g·σ)``, ``A' = s·A``, ``ds = Σ_n dA'·A`` (fp32, fixed
    reduction order, bitwise deterministic).

    Args:
        da_prime: ``(P, n)`` bf16, contiguous, CUDA, 16-byte aligned.
        h: ``(P, 2n)`` bf16, contiguous, same device, 16-byte aligned; ``n`` a multiple of 8.
            With ``h_scales``: H in e4m3 (the FP8 activation cache), 8-byte aligned, ``2n`` a
            multiple of 128.
        row_scores: ``(P,)`` fp32, contiguous, same device — the score of each row.
        gate_up: ``"concat"`` or ``"interleaved"`` (see :func:`swiglu`).
        h_scales: ``(2n/128, P)`` fp32, contiguous: the 1×128 scales of an e4m3 ``h``
            (:func:`sonic.kernels.fp8_quant.quantize_rows`'s layout). H is dequantized as it
            is loaded, bitwise :func:`~sonic.kernels.fp8_quant.dequantize_rows` (the same dH,
            A' and ds as dequantizing first), without writing and reading a bf16 H.
        dh_out: ``(P, 2n)`` bf16, contiguous, 16-byte aligned: where dH is written, allocated if
            None. It may be ``h`` itself (dH then overwrites H; not with ``h_scales``).
        a_out: ``(P, n)`` bf16, contiguous, 16-byte aligned: where A' is written, allocated if
            None. It may be ``da_prime`` itself (A' then overwrites dA').
        In place is safe because each lane loads every element of its row slices (H's gate
        and up, dA') before it stores any, and stores exactly the elements it loaded; rows
        belong to one warp each. A buffer that overlaps an input without being it would
        overwrite elements other lanes still read: refused.
        quantize_dh: also write dH as the FP8 path's dX GEMM reads it (issue 18): e4m3 with
            one fp32 scale per 1×128 slice of each dH row, bitwise
            ``sonic.kernels.fp8_quant.quantize_rows(dH)``, without reading dH again; needs
            ``n`` a multiple of 128. The FP8 layer's default for its dX GEMM
            (:func:`sonic.backend.set_fp8_epilogues`).

    Returns:
        ``(dH (P, 2n) bf16, A' (P, n) bf16, ds (P,) fp32)``, with ``quantize_dh`` followed by
        ``dH_q (P, 2n) float8_e4m3fn, dH_scales (2n/128, P) fp32``; dH is ``dh_out`` and A' is
        ``a_out`` when given. ``P = 0`` returns empty tensors without a launch (``n = 0``:
        ``ds`` is zeros).

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not a contiguous CUDA tensor of the right rank, the tensors are
            on different devices, shapes disagree, ``n`` is not a multiple of 8, a bf16 tensor is
            not 16-byte aligned, ``gate_up`` is unknown, ``dh_out`` / ``a_out`` overlaps an
            input without being ``h`` / ``da_prime``, ``quantize_dh`` with ``n`` not a
            multiple of 128, or ``h_scales`` of another shape than ``(2n/128, P)``.
    """
    if h_scales is not None:
        n = _check_h(h, gate_up, torch.float8_e4m3fn)
        if (2 * n) % FP8_BLOCK:
            raise ValueError(f"an e4m3 h needs 2n a multiple of {FP8_BLOCK} (whole 1x"
                             f"{FP8_BLOCK} scale slices), got 2n = {2 * n}")
        runtime.check_tensor("h_scales", h_scales, dtypes=(torch.float32,), ndim=2,
                             device=h.device)
        if tuple(h_scales.shape) != (2 * n // FP8_BLOCK, h.shape[0]):
            raise ValueError(f"h_scales must have shape (2n/128, P) = "
                             f"{(2 * n // FP8_BLOCK, h.shape[0])}, got {tuple(h_scales.shape)}")
    else:
        n = _check_h(h, gate_up)
    if quantize_dh and n % FP8_BLOCK:
        raise ValueError(f"dswiglu_epilogue(quantize_dh=True) needs n a multiple of {FP8_BLOCK}"
                         f" (whole 1x{FP8_BLOCK} scale slices), got n = {n}")
    runtime.check_tensor("da_prime", da_prime, dtypes=(torch.bfloat16,), ndim=2, device=h.device)
    runtime.check_tensor("row_scores", row_scores, dtypes=(torch.float32,), ndim=1,
                         device=h.device)
    num_rows = h.shape[0]
    if tuple(da_prime.shape) != (num_rows, n):
        raise ValueError(f"da_prime must have shape (P, n) = {(num_rows, n)} to match h "
                         f"{tuple(h.shape)}, got {tuple(da_prime.shape)}")
    if row_scores.numel() != num_rows:
        raise ValueError(f"row_scores must have one entry per row of h ({num_rows}), "
                         f"got {row_scores.numel()}")
    if h_scales is not None and dh_out is None:   # bf16 dH beside the e4m3 H
        dh = torch.empty(h.shape, dtype=torch.bfloat16, device=h.device)
    else:
        dh = _output("dh_out", dh_out, h, (da_prime,) + ((h,) if h_scales is not None else ()))
    a_scaled = _output("a_out", a_out, da_prime, (h,))
    ds = torch.empty(num_rows, dtype=torch.float32, device=h.device)
    quantized = ()
    if quantize_dh:
        quantized = _quantized_like(num_rows, 2 * n, h.device)
    if num_rows == 0:
        return dh, a_scaled, ds, *quantized
    if n == 0:
        return dh, a_scaled, ds.zero_(), *quantized
    h_fp8 = h_scales is not None
    fn = runtime.compiled(("dswiglu_epilogue", n, gate_up, quantize_dh, h_fp8),
                          lambda: _compile(n, gate_up, True, quantize=quantize_dh, h_fp8=h_fp8))
    adr = runtime.address
    ha = adr(h, 8 if h_fp8 else 16)
    # Without quantize_dh the kernel never touches dH_q and its scales, without h_scales
    # never H's scales; h's address stands in.
    q_addresses = ((adr(quantized[0], 16), adr(quantized[1], 4)) if quantize_dh
                   else (ha,) * 2)
    fn(ha, adr(da_prime, 16), adr(row_scores, 4), adr(a_scaled, 16), adr(dh, 16),
       adr(ds, 4), *q_addresses, adr(h_scales, 4) if h_fp8 else ha, num_rows)
    return dh, a_scaled, ds, *quantized


_MARKERS = ("ld.global.v4", "st.global.v4")
for _n, _gate_up, _backward in ((256, "concat", False), (1024, "interleaved", False),
                                (256, "interleaved", True), (1024, "concat", True)):
    register(KernelVariant(
        kernel="swiglu",
        variant=f"{'dswiglu' if _backward else 'swiglu'}_n{_n}_{_gate_up}",
        compile_fake=lambda n=_n, g=_gate_up, b=_backward: _compile(n, g, b, keep_ptx=True),
        ptx_markers=_MARKERS + (("shfl.sync.bfly",) if _backward else ())))
# With quantize (A, or dH as well): the saturating e4m3 conversion, the block amax shuffles and
# 8-byte fp8 stores beside each kernel's own markers. n = 384: a partial last pass (lanes past
# n shuffle, store nothing).
_FP8_STORES = ("st.global.v2.b32", "st.global.v2.u32", "st.global.b64", "st.global.u64")
for _backward, _h in ((False, False), (True, False), (False, True)):
    for _n, _gate_up in ((384, "concat"), (1024, "interleaved")):
        register(KernelVariant(
            kernel="swiglu",
            variant=f"{'dswiglu' if _backward else 'swiglu'}_quantized{'_h' if _h else ''}"
                    f"_n{_n}_{_gate_up}",
            compile_fake=lambda n=_n, g=_gate_up, b=_backward, qh=_h: _compile(
                n, g, b, keep_ptx=True, quantize=True, quantize_h=qh),
            ptx_markers=(_MARKERS if _backward else _MARKERS[:1])
            + ("cvt.rn.satfinite.e4m3x2.f32", "shfl.sync.bfly", _FP8_STORES)))
# The backward reading H in e4m3 (the FP8 activation cache): the e4m3 upcast beside the
# backward's markers; with and without dH quantized.
for _n, _gate_up, _q in ((384, "concat", True), (1024, "interleaved", False)):
    register(KernelVariant(
        kernel="swiglu",
        variant=f"dswiglu_h_fp8{'_quantized' if _q else ''}_n{_n}_{_gate_up}",
        compile_fake=lambda n=_n, g=_gate_up, q=_q: _compile(
            n, g, True, keep_ptx=True, quantize=q, h_fp8=True),
        ptx_markers=_MARKERS + ("shfl.sync.bfly", "e4m3x2")))
