"""The interfaces the grouped-GEMM kernel's parts meet: tile schedulers and accumulator views.

:class:`TileScheduler` is what the warp roles ask of a scheduler
(:mod:`.tile_scheduler`: varlen-M, varlen-K); :class:`AccumulatorView` is what an epilogue
(:mod:`.epilogue`) reads a finished fp32 accumulator through, whatever holds it
(:class:`.sm90.WgmmaAccumulator`: WGMMA registers; :class:`.sm100.TmemAccumulator`: tensor
memory). Every method runs while the kernel is traced.

Pure Python (no ``cutlass``).
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

from sonic.kernels.grouped_gemm.args import SchedulerArgs, TileCoord


@runtime_checkable
class TileScheduler(Protocol):
    """A static persistent scheduler: CTA (cluster) ``b`` of ``G`` takes work items ``b, b +
    G, ...``; producer and consumer warps decode the same sequence."""

    def prepare(self, sched: SchedulerArgs) -> None:
        """Warp 0, before the roles start: build what :meth:`decode` reads (the shared-memory
        tile table), made visible by the CTA (cluster) barrier that follows."""

    def total(self, sched: SchedulerArgs) -> Any:
        """The number of work items (``Int32``)."""

    def decode(self, t: Any, sched: SchedulerArgs) -> TileCoord:
        """Work item ``t`` → its tile coordinates (this CTA's tile on a cluster)."""

    def tile_k_tiles(self, t: Any, sched: SchedulerArgs) -> Any:
        """The k-tiles of work item ``t``'s tile: the ring stages its mainloop consumes."""


@runtime_checkable
class AccumulatorView(Protocol):
    """A warpgroup's fp32 accumulator tile as sub-tiles of ``SLAB`` columns, each a set of
    this thread's column pairs (two adjacent columns of one row).

    Attributes:
        rows_per_thread: distinct tile rows this thread holds values of.
        pairs_per_slab: column pairs this thread holds per sub-tile.
        warp_private: a warp holds whole rows, so an epilogue may stage and store them
            without the warpgroup's other warps.
        matrix_fragments: each 8-column group's pairs over a warp's 8 rows are the 8 x 8
            matrix fragments of ``stmatrix``, :meth:`pairs` yielding a group's two 8-row
            halves in turn (sm_90's WGMMA accumulator).
    """

    rows_per_thread: int
    pairs_per_slab: int
    warp_private: bool
    matrix_fragments: bool

    def pairs(self, sl: int) -> Iterator[Any]:
        """This thread's column pairs of sub-tile ``sl``, each with ``.row`` (which of the
        thread's rows) and ``.index`` (its position among the sub-tile's pairs)."""

    def coord(self, p: Any, v0: int = 0) -> tuple[Any, Any]:
        """``(m, n)``: tile row and column of value ``v0`` (0 or 1) of pair ``p``."""

    def value(self, p: Any, v0: int, sl: int | None = None) -> Any:
        """fp32 value ``v0`` of pair ``p``, or of the same position in sub-tile ``sl``."""

    def row_coord(self, i: int) -> Any:
        """Tile row of this thread's row ``i`` (``0 .. rows_per_thread``)."""

    def reduce_row(self, x: Any) -> Any:
        """Sum of ``x`` over the threads holding the same rows."""

    def writes_row_total(self, lane: Any) -> Any:
        """Whether this thread stores a row's reduced value (:meth:`reduce_row`)."""
