"""The operand ring: shared-memory stages handed between producer and consumer warps.

Each stage has two mbarriers, ``full`` (producer -> consumers: the stage's bytes landed) and
``empty`` (consumers -> producers: every reading warp is done with it); their arrival counts
are :func:`sonic.kernels.grouped_gemm.config.barrier_contract`. A position in the ring is
``(stage, phase)``: producers start at phase 1 (every stage free), consumers at phase 0.
Imports ``cutlass``: only the kernel modules import this one.
"""

import cutlass
from cutlass import Int32, cute

from sonic.kernels.grouped_gemm.config import GroupedGemmConfig


class OperandRing:
    """Ring position arithmetic and the cluster-wide release of a stage."""

    def __init__(self, cfg: GroupedGemmConfig):
        self.stages = cfg.stages
        self.cluster = cfg.cluster

    @cute.jit
    def next_stage(self, stage: Int32, phase: Int32):
        """The ring position after ``stage``: the phase flips when the ring wraps."""
        stage += 1
        if stage == self.stages:
            stage = 0
            phase ^= 1
        return stage, phase

    @cute.jit
    def skip(self, stage: Int32, phase: Int32, k_tiles: Int32):
        """Advance a consumer's ring position past ``k_tiles`` stages."""
        ahead = stage + k_tiles
        wraps = ahead // self.stages
        return ahead - wraps * self.stages, phase ^ (wraps & 1)

    @cute.jit
    def release(self, empty_stage: cute.Pointer, lane: Int32):
        """A consumer warp is done reading a stage: arrive on its empty barrier in every CTA
        of the cluster (each CTA's producers write into the stage of both)."""
        if cutlass.const_expr(self.cluster > 1):
            if lane < self.cluster:
                cute.arch.mbarrier_arrive(empty_stage, lane)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive(empty_stage)

    @cute.jit
    def sync_cluster(self):
        """Barrier over the CTA, or over the cluster (barrier init and tile table visible
        to the peer before its first multicast or remote arrive)."""
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
