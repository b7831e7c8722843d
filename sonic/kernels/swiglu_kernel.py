"""The one-pass SwiGLU / dSwiGLU-epilogue kernel class (imports ``cutlass``).

:mod:`sonic.kernels.swiglu` describes the algorithm, validates arguments and launches; it
imports this module on the first compile, so ``import sonic`` does not need ``cutlass``.
"""

import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, cute
from cuda.bindings import driver as cuda

from sonic.kernels import activation, runtime
from sonic.kernels import fp8_quant_kernel as fp8
from sonic.kernels.swiglu import (LANES_PER_BLOCK, ROW_CHUNK, ROW_CHUNK_FP8_CACHE, ROW_PASSES,
                                  VEC, WARP, WARPS)
from sonic.types import FP8_BLOCK


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
        # Passes per chunk of a long row.
        self.chunk = ROW_CHUNK_FP8_CACHE if quantize_h or h_fp8 else ROW_CHUNK
        self.held = self.iters if self.iters <= ROW_PASSES else self.chunk
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
            h_frags = [cute.make_rmem_tensor(frag_layout, BFloat16) for _ in range(self.held)]
            loaded = h_frags
            if cutlass.const_expr(self.h_fp8):
                loaded = [cute.make_rmem_tensor(frag_layout, Float8E4M3FN)
                          for _ in range(self.held)]
            dap_frags = [cute.make_rmem_tensor((VEC,), BFloat16) if self.backward else None
                         for _ in range(self.held)]
            # What every chunk of the row shares (see _chunk).
            shared = (h_row, da_prime, row_scores, a, dh, ds, dh_q, dh_scales, h_scales, row,
                      num_rows, out_row, lane, h_layout, (h_frags, loaded, dap_frags))
            partial = Float32(0.0)
            score = Float32(0.0)
            if cutlass.const_expr(self.iters <= ROW_PASSES):
                partial, score = self._chunk(*shared, score, partial, (0, self.iters, True),
                                             True)
            else:
                # A long row: its chunks of whole passes in a loop the compiler keeps rolled
                # (unrolled, the quantizing backward at n = 14336 compiles to 0.6 MB of
                # machine code), then what is left in straight-line code.
                if cutlass.const_expr(self.backward):
                    score = cute.make_tensor(row_scores, cute.make_layout(num_rows))[row]
                looped = self.slices // WARP // self.chunk
                for c in cutlass.range(looped, unroll=1):
                    partial, score = self._chunk(*shared, score, partial,
                                                 (c * self.chunk, self.chunk, False), False)
                if cutlass.const_expr(looped * self.chunk < self.iters):
                    partial, score = self._chunk(*shared, score, partial,
                                                 (looped * self.chunk,
                                                  self.iters - looped * self.chunk, True), False)
            if cutlass.const_expr(self.backward):
                for k in cutlass.range_constexpr(5):
                    partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=16 >> k)
                if lane == 0:
                    cute.make_tensor(ds, cute.make_layout(num_rows))[row] = partial

    @cute.jit
    def _chunk(self, h_row: cute.Pointer, da_prime: cute.Pointer, row_scores: cute.Pointer,
               a: cute.Pointer, dh: cute.Pointer, ds: cute.Pointer, dh_q: cute.Pointer,
               dh_scales: cute.Pointer, h_scales: cute.Pointer, row: Int32, num_rows: Int32,
               out_row: Int64, lane: Int32, h_layout: cute.Layout, frags: tuple, score: Float32,
               partial: Float32, chunk: tuple, load_score: bool):
        """Load, compute and store the passes of ``chunk`` (see :meth:`_pass`) into the
        fragments ``frags = (h_frags, loaded, dap_frags)``; with ``load_score`` (backward)
        the row's score after the loads. Returns ``(partial + Σ dA'·A over the chunk,
        score)``."""
        h_frags, loaded, dap_frags = frags
        # All loads of the chunk are issued before any of its stores: the compiler cannot
        # move a load above a store that may alias it, so this is what keeps them in flight.
        for j in cutlass.range_constexpr(chunk[1]):
            col, whole = self._pass(lane, chunk, j)
            pair = (loaded[j], dap_frags[j])
            if cutlass.const_expr(whole):
                self._load(h_row, da_prime, out_row, col, h_layout, *pair)
            elif col < self.n:
                self._load(h_row, da_prime, out_row, col, h_layout, *pair)
        if cutlass.const_expr(self.h_fp8):
            self._dequantize(h_scales, row, num_rows, lane, loaded, h_frags, chunk)
        if cutlass.const_expr(self.backward and load_score):
            score = cute.make_tensor(row_scores, cute.make_layout(num_rows))[row]
        if cutlass.const_expr(self.quantize and not self.backward):
            self._finish_quantized(a, ds, dh_q, dh_scales, row, num_rows, out_row, lane,
                                   h_layout, h_frags, chunk)
        if cutlass.const_expr(self.quantize and self.backward):
            partial = self._finish_dh_quantized(a, dh, dh_q, dh_scales, row, num_rows, out_row,
                                                lane, score, h_layout, h_frags, dap_frags,
                                                partial, chunk)
        for j in cutlass.range_constexpr(chunk[1] if not self.quantize else 0):
            col, whole = self._pass(lane, chunk, j)
            pair = (h_frags[j], dap_frags[j])
            if cutlass.const_expr(whole):
                partial = self._finish(a, dh, out_row, col, score, partial, h_layout, *pair)
            elif col < self.n:
                partial = self._finish(a, dh, out_row, col, score, partial, h_layout, *pair)
        return partial, score

    def _pass(self, lane, chunk, j):
        """Pass ``j`` of ``chunk = (first pass, passes, static)``: this lane's first column,
        and whether the whole pass lies inside the row (only the row's last pass can run past
        it, and only when 32·8 ∤ n). ``static``: ``first pass`` is a Python int; else a
        runtime value, and every pass of the chunk is whole. Traced inline."""
        first, _, static = chunk
        whole = not static or (first + j + 1) * WARP <= self.slices
        return (lane + (first + j) * WARP) * VEC, whole

    @cute.jit
    def _finish_quantized(self, q: cute.Pointer, scales: cute.Pointer, h_q: cute.Pointer,
                          h_scales: cute.Pointer, row: Int32, num_rows: Int32,
                          out_row: Int64, lane: Int32, h_layout: cute.Layout,
                          h_frags: list, chunk: tuple):
        """Forward with A quantized: per 8-column slice, A rounded to bf16 (the values
        :func:`sonic.kernels.fp8_quant.quantize_rows` would read), the amax of each
        128-column block over its 16 lanes (every lane shuffles, those past ``n`` with 0),
        then ``q`` and, from the block's first lane, its scale at ``scales[block, row]``.
        With ``quantize_h``, the loaded H as well (:meth:`_store_quantized_h`). Over the
        passes of ``chunk`` (:meth:`_pass`)."""
        for j in cutlass.range_constexpr(chunk[1]):
            col, whole = self._pass(lane, chunk, j)
            vals = cute.make_rmem_tensor((VEC,), Float32)
            h_vals = cute.make_rmem_tensor((2, VEC), Float32)
            amax = Float32(0.0)
            amax_g, amax_u = Float32(0.0), Float32(0.0)
            if cutlass.const_expr(whole):
                amax = self._rounded_act(h_frags[j], vals)
                if cutlass.const_expr(self.quantize_h):
                    amax_g, amax_u = self._pair_values(h_frags[j], h_vals)
            elif col < self.n:
                amax = self._rounded_act(h_frags[j], vals)
                if cutlass.const_expr(self.quantize_h):
                    amax_g, amax_u = self._pair_values(h_frags[j], h_vals)
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
                                        h_layout, h_frags[j].layout, h_vals, amax_g,
                                        amax_u)

    @cute.jit
    def _dequantize(self, scales: cute.Pointer, row: Int32, num_rows: Int32, lane: Int32,
                    q_frags: list, h_frags: list, chunk: tuple):
        """``h_frags`` = the loaded e4m3 slices times their 1×128 blocks' scales, rounded to
        bf16: bitwise :func:`sonic.kernels.fp8_quant.dequantize_rows`. After all loads
        are issued, so they stay in flight. A lane past ``n`` reads no scale (its values
        are never stored). Over the passes of ``chunk`` (:meth:`_pass`)."""
        per_row = scales + Int64(row)
        for j in cutlass.range_constexpr(chunk[1]):
            col, _ = self._pass(lane, chunk, j)
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
                h_frags[j][half, None].store(
                    (q_frags[j][half, None].load().to(Float32) * scale).to(BFloat16))

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
                             h_layout: cute.Layout, h_frags: list, dap_frags: list,
                             partial: Float32, chunk: tuple):
        """Backward with dH also in e4m3 (the dX GEMM's operand): per slice of the passes
        of ``chunk`` (:meth:`_pass`), what :meth:`_finish` stores, then the bf16 dH values
        it stored in e4m3 per 1×128 block (:meth:`_store_quantized_h`). Returns
        ``partial + Σ dA'·A`` over this lane's slices."""
        for j in cutlass.range_constexpr(chunk[1]):
            col, whole = self._pass(lane, chunk, j)
            vals = cute.make_rmem_tensor((2, VEC), Float32)
            amax_g, amax_u = Float32(0.0), Float32(0.0)
            if cutlass.const_expr(whole):
                partial, amax_g, amax_u = self._finish(a, dh, out_row, col, score, partial,
                                                       h_layout, h_frags[j], dap_frags[j],
                                                       vals)
            elif col < self.n:
                partial, amax_g, amax_u = self._finish(a, dh, out_row, col, score, partial,
                                                       h_layout, h_frags[j], dap_frags[j],
                                                       vals)
            self._store_quantized_h(q, scales, row, num_rows, out_row, lane, col, h_layout,
                                    h_frags[j].layout, vals, amax_g, amax_u)
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
            gDap = cute.make_tensor(da_prime + (out_row + col), cute.make_layout(VEC))
            cute.autovec_copy(gDap, dap_frag)

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
