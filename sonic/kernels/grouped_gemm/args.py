"""Argument bundles of the grouped-GEMM kernel: one named field per operand, copy or buffer.

The kernel's arguments travel in these named tuples instead of positional slots. The CuTe DSL
flattens a (named) tuple argument of a ``@cute.kernel`` into its leaves in field order and
rebuilds it inside the kernel, and a ``None`` leaf passes nothing, so a field left ``None``
compiles its feature out. The only flat signature is the compiled launcher's,
:meth:`.base.GroupedGemmKernel.__call__` (``runtime.compile_launcher`` marshals integers), whose
address parameters follow :class:`Operands` field for field; adding an operand is one field
here and one parameter there.

Pure Python (no ``cutlass``): the dispatcher builds :class:`Operands` and :class:`Sizes`
without the CuTe DSL.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Operands(NamedTuple):
    """The global-memory operands of one launch: device addresses (``int``) on the host,
    ``Int64`` at the launcher's entry. ``None``: the configuration never reads the operand.

    Attributes:
        a, b: the GEMM operands (varlen-M ``(rows_a, K)`` and ``(E, N, K)``; varlen-K
            ``(rows_a, M)`` and ``(rows_b, N)``, or FP8 K-major copies ``(M, R)``, ``(N, R)``).
        c: the output (C, or the SwiGLU epilogue's H, or the dSwiGLU epilogue's dH).
        act: SwiGLU's A or dSwiGLU's A'.
        h, scores, ds: the dSwiGLU epilogue's saved H, row scores and ds partials.
        gather_a, gather_b: the gather indices of A's and B's rows.
        offsets: ``expert_offsets`` (E+1,) int32.
        a_scales, b_scales: the FP8 block scales of A and B.
    """

    a: Any
    b: Any
    c: Any
    act: Any = None
    h: Any = None
    scores: Any = None
    ds: Any = None
    gather_a: Any = None
    gather_b: Any = None
    offsets: Any = None
    a_scales: Any = None
    b_scales: Any = None

    def addresses(self) -> tuple:
        """The launcher's address arguments in field order. An operand the configuration
        never reads (``None``) passes C's address, which no such kernel dereferences (a
        16-byte aligned address satisfies every alignment the kernel assumes)."""
        return tuple(self.c if x is None else x for x in self)


class Sizes(NamedTuple):
    """The launch's runtime sizes (``Int32``), after the addresses.

    Attributes:
        rows_a, rows_b: source rows of A and B (varlen-M: ``rows_b`` is P; FP8 varlen-K: both
            are R, the padded rows of the K-major copies).
        num_experts: E.
        num_ctas: the persistent grid (a multiple of the cluster size).
    """

    rows_a: Any
    rows_b: Any
    num_experts: Any
    num_ctas: Any


class Tma(NamedTuple):
    """One TMA copy: its atom and the global tensor it partitions."""

    atom: Any
    tensor: Any


class OperandTmas(NamedTuple):
    """The TMA loads of A and B (:meth:`.load.TmaProducers.make_operand_tmas`); ``None``
    where the configuration has none.

    Attributes:
        a, b: tile boxes (gathered varlen-M A: one-row boxes; bf16 varlen-K: ``64 x TILE_K``
            boxes).
        a_row, b_row: bf16 varlen-K ``64 x 1`` row boxes.
        mc, mc_row: the cluster's multicast copies of the operand it shares, B's or
            (``multicast_a``) A's, as ``a``/``b`` and ``a_row``/``b_row``.
    """

    a: Tma
    b: Tma
    a_row: Tma | None = None
    b_row: Tma | None = None
    mc: Tma | None = None
    mc_row: Tma | None = None


class BlockScales(NamedTuple):
    """The FP8 block scales' global pointers (fp32), read by the mainloop."""

    a: Any
    b: Any


class KernelPointers(NamedTuple):
    """The global pointers the kernel dereferences itself (the rest reach it as TMA copies).

    Attributes:
        epilogue: :class:`EpilogueOutputs`.
        scales: :class:`BlockScales` for the FP8 configurations, else None.
    """

    epilogue: EpilogueOutputs
    scales: BlockScales | None


class EpilogueOutputs(NamedTuple):
    """The epilogues' global pointers: C (store: the output, SwiGLU: H, dSwiGLU: dH), act
    (SwiGLU's A, dSwiGLU's A'), the dSwiGLU row scores and ds partials."""

    c: Any
    act: Any
    scores: Any
    ds: Any


class RowSources(NamedTuple):
    """Where the operands' rows come from: the gather indices (pointers, read only where the
    configuration gathers) and the source row counts (``Int32``)."""

    gather_a: Any
    gather_b: Any
    rows_a: Any
    rows_b: Any


class SchedulerArgs(NamedTuple):
    """What the tile scheduler reads: ``offsets`` (the ``(E+1,)`` expert offsets as a
    tensor), ``table`` (in shared memory: varlen-M's per-expert first m-tile, varlen-K's
    copy of the offsets) and ``num_experts``."""

    offsets: Any
    table: Any
    num_experts: Any


class WorkItems(NamedTuple):
    """The CTA's work items ``first, first + step, ... < total``."""

    first: Any
    step: Any
    total: Any


class TileCoord(NamedTuple):
    """A work item decoded by the scheduler.

    Attributes:
        expert: the expert ``e``.
        row0: the tile's first row of ``P`` (varlen-K: the expert's first row).
        rows: rows of the expert from ``row0`` (0 for a cluster's phantom tile).
        n_tile, m_tile: the tile's n-tile and m-tile (varlen-M's ``m_tile`` counts within
            the expert).
        shared: both CTAs of the cluster load the same B tile (multicast).
    """

    expert: Any
    row0: Any
    rows: Any
    n_tile: Any
    m_tile: Any
    shared: Any


class StageMemory(NamedTuple):
    """The operand ring in shared memory.

    Attributes:
        a, b: the A and B stages as swizzled tensors (the MMA's operands).
        a_base, b_base: raw pointers of A's and B's space (row copies, an epilogue's loads).
        a_swizzle, b_swizzle: the stages' 128-byte swizzles.
        col_scales: the stages' B column scales (FP8 varlen-K), else None.
        full, empty: the ring's mbarriers (:mod:`.pipeline`).
    """

    a: Any
    b: Any
    a_base: Any
    b_base: Any
    a_swizzle: Any
    b_swizzle: Any
    col_scales: Any
    full: Any
    empty: Any


class EpilogueThreads(NamedTuple):
    """The threads running an epilogue: one warpgroup and its staging buffer.

    Attributes:
        staging: the warpgroup's staging buffer (bf16 pointer).
        tid: the thread in the warpgroup.
        index: the warpgroup (its named barrier).
        row0: the warpgroup's first tile row.
        lane: the thread that releases ring stages where it is 0
            (:meth:`.pipeline.OperandRing.release`): the lane on sm_90, one per warp; sm_100
            passes the epilogue thread index, one arrival per stage.
    """

    staging: Any
    tid: Any
    index: Any
    row0: Any
    lane: Any
