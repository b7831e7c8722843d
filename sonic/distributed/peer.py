"""The copy-engine transport of expert parallelism: all-to-all through NVLink peer memory,
moved by the GPUs' copy engines and ordered by stream memory operations — no SM is used.

Inside one NVLink node this transport moves the rows with the GPUs' copy engines instead of
NCCL's kernels (the low-contention design of PyTorch's symmetric-memory collectives: the
communication takes no SM from the compute it overlaps), gathers the rows sent by index
straight into its send buffer, and copies what it receives straight into the output. Measured
on H200s it is level with NCCL in the layer, and NCCL's kernels too run beside sonic's
persistent GEMMs (docs/expert-parallelism.md):

* every rank of the group allocates one send buffer in symmetric memory
  (``torch.distributed._symmetric_memory``: each rank's allocation mapped into every peer's
  address space) with a region per (slot, peer), and a signal pad of flags;
* for one all-to-all, the exchange with each peer ``j`` runs on a stream of its own:

  1. wait until ``j`` has pulled what this rank last put in the slot (``done`` flag);
  2. write the rows for ``j`` into region ``j`` — a copy or, for rows gathered by an index, a
     gather kernel writing there directly (no staging tensor);
  3. raise the ``ready`` flag in ``j``'s pad (``cuStreamWriteValue32``: executed by the
     stream's front end, after a system-wide memory fence);
  4. wait for ``j``'s ``ready`` flag (``cuStreamWaitValue32``: the stream's front end waits,
     no SM spins), copy ``j``'s region for this rank from ``j``'s memory straight into the
     output rows (over NVLink);
  5. raise the ``done`` flag in ``j``'s pad.

  Steps 1–3 for every peer come first, then (after a join on the caller's stream) steps 4–5:
  every ``ready`` flag is raised before any is awaited, so a stream blocked in a wait can
  never hold up a flag another rank waits for. The rows for this rank itself are copied
  locally. Two slots alternate, so one all-to-all's sends never wait for the previous one's
  readers.

Copies go through ``cuMemcpyBatchAsync`` with the hint to overlap compute
(``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, CUDA 12.8+), which asks the driver for a
copy engine; on the legacy default stream (which batched copies refuse), where the driver or
the bindings lack the call, or once the driver refuses it, ``Tensor.copy_`` is used (the same
bytes; ``benchmarks/bench_ep_transport.py`` times both). Gathers by an index stay kernels.

Flags carry a generation number per slot that grows by one per use; a wait is a cyclic
greater-or-equal, so nothing is reset between calls. Every rank of the group must run the same
sequence of all-to-alls (the layer's collectives guarantee it: the settings that decide the
sequence are agreed in the count exchange). A peer that stops midway leaves this rank's streams
waiting; the next NCCL collective behind them then times out in the process group's watchdog,
which bounds the wait as it does for NCCL's own all-to-all.

Buffers: :meth:`PeerTransport.reserve` sizes the regions (collective: every rank passes the
same size, which the count exchange of :func:`~sonic.distributed.plan.plan_dispatch` makes
known to all); they grow, never shrink, and are shared by every layer of the group on the
device: ``2 · ep · region`` bytes per rank.

NVLink multicast is never used (no multicast object, NVLS or multimem operation).
"""

from __future__ import annotations

import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist

from sonic.distributed.comm import check_group

# Slots of the send buffer used in turn (two: an all-to-all fills one while peers may still
# be reading the other).
_SLOTS = 2
# Regions are rounded up to this many bytes (and so aligned to it: any dtype's rows fit).
_ALIGN = 2 << 20
_TRANSPORTS: dict[tuple[str, int], "PeerTransport"] = {}
_SAME_HOST: dict[str, bool] = {}


def _driver():
    """The CUDA driver bindings (``cuda-bindings``, which CuTe DSL depends on)."""
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise RuntimeError("transport='copy_engine' needs the cuda-bindings package (pip "
                           "install cuda-bindings; it comes with sonic's gpu extra)") from error
    return driver


def _copy_engine_attributes(cu, device: torch.device):
    """The ``CUmemcpyAttributes`` of a device-to-device copy that prefers a copy engine, or
    ``None`` where the bindings or the driver (CUDA < 12.8) do not offer batched copies."""
    if not hasattr(cu, "cuMemcpyBatchAsync"):
        return None
    error, version = cu.cuDriverGetVersion()
    if error != cu.CUresult.CUDA_SUCCESS or version < 12080:
        return None
    attributes = cu.CUmemcpyAttributes()
    attributes.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attributes.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    # The hints matter only for managed memory; they are set to this device all the same.
    here = cu.CUmemLocation()
    here.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    here.id = device.index
    attributes.srcLocHint = attributes.dstLocHint = here
    return attributes


def _process_group(group):
    """``group``, or the default group for ``None``."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _group_name(group) -> str:
    return _process_group(group).group_name


def peer_transport_available(group, device: torch.device) -> bool:
    """Whether :class:`PeerTransport` can serve ``group`` on ``device``: a CUDA device, an
    NCCL group whose ranks all run on this host (peer memory does not cross nodes). Collective
    the first time per group (one ``all_gather_object`` of the host names), cached after."""
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        return False
    name = _group_name(group)
    if name not in _SAME_HOST:
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _SAME_HOST[name] = len(set(hosts)) == 1
    return _SAME_HOST[name]


def peer_transport(group, device: torch.device) -> "PeerTransport":
    """The :class:`PeerTransport` of ``group`` on ``device`` (one per pair, made on first
    use; collective then, like every later :meth:`PeerTransport.reserve`).

    Raises:
        ValueError: the group is not an NCCL group of CUDA ranks on one host.
    """
    if not peer_transport_available(group, device):
        raise ValueError("transport='copy_engine' needs CUDA tensors and an NCCL group whose "
                         "ranks all run on one host (peer memory does not cross nodes); use "
                         "transport='nccl'")
    key = (_group_name(group), device.index)
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = PeerTransport(group, device)
    return _TRANSPORTS[key]


class PeerTransport:
    """All-to-all of rows between the ranks of an NCCL group on one host, through symmetric
    memory and copy engines (module docstring). Made by :func:`peer_transport`.

    Args:
        group: the EP process group (``None``: the default group).
        device: this rank's CUDA device.

    Attributes:
        prefer_copy_engine: copy through ``cuMemcpyBatchAsync`` with the hint to overlap
            compute (default ``True``; ignored where the driver lacks it); ``False``: through
            ``Tensor.copy_``. The same bytes either way.
    """

    def __init__(self, group, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self._cu = _driver()
        self.group, self.device = group, device
        self.ep_size, self.ep_rank = check_group(group)
        self.region_bytes = 0
        self._uses = 0
        # The symmetric allocation and its handle, every rank's view of its buffer (this
        # rank's own at its index) and every rank's signal-pad address; set by reserve().
        self._buffer: torch.Tensor | None = None
        self._handle: Any = None
        self._regions: list[torch.Tensor] = []
        self._pads: list[int] = []
        self._streams = [torch.cuda.Stream(device) for _ in range(self.ep_size)]
        self._copy_attributes = _copy_engine_attributes(self._cu, device)
        self.prefer_copy_engine = True

    def reserve(self, region_bytes: int) -> None:
        """Collective: make every region hold at least ``region_bytes`` bytes; every rank must
        pass the same value. Growing waits for this device's queued work and meets every peer
        (they may still read the old buffer until then)."""
        if region_bytes <= self.region_bytes:
            return
        region = -(-region_bytes // _ALIGN) * _ALIGN
        torch.cuda.synchronize(self.device)
        group = _process_group(self.group)
        # One region per peer and slot: a rank's rows for itself are copied locally.
        peers = max(self.ep_size - 1, 1)
        buffer = self._symm_mem.empty(_SLOTS, peers, region, dtype=torch.uint8,
                                      device=self.device)
        handle = self._symm_mem.rendezvous(buffer, group)
        flags = 2 * _SLOTS * self.ep_size
        handle.get_signal_pad(self.ep_rank, (flags,), dtype=torch.int32).zero_()
        torch.cuda.synchronize(self.device)
        # No peer raises a flag in this rank's new pad before it is zeroed.
        dist.barrier(group=self.group, device_ids=[self.device.index])
        self._buffer, self._handle = buffer, handle
        self._regions = [handle.get_buffer(j, (_SLOTS, peers, region), torch.uint8)
                         for j in range(self.ep_size)]
        self._pads = list(handle.signal_pad_ptrs)
        self.region_bytes, self._uses = region, 0

    def _flag(self, rank: int, kind: int, slot: int, source: int):
        """Address of flag ``kind`` (0 ready, 1 done) of ``slot`` from ``source`` in the pad of
        ``rank``."""
        return self._cu.CUdeviceptr(self._pads[rank]
                                    + 4 * ((kind * _SLOTS + slot) * self.ep_size + source))

    def _wait(self, stream, address, value: int) -> None:
        (error,) = self._cu.cuStreamWaitValue32(
            self._cu.CUstream(stream.cuda_stream), address, value & 0xFFFFFFFF,
            self._cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self._check(error, "cuStreamWaitValue32")

    def _signal(self, stream, address, value: int) -> None:
        (error,) = self._cu.cuStreamWriteValue32(
            self._cu.CUstream(stream.cuda_stream), address, value & 0xFFFFFFFF,
            self._cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        self._check(error, "cuStreamWriteValue32")

    @property
    def copies_on_copy_engine(self) -> bool:
        """Whether copies go through the hinted batched call (:attr:`prefer_copy_engine`, and
        the driver offers it and has not refused it)."""
        return self.prefer_copy_engine and self._copy_attributes is not None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream, on a copy engine where the driver takes
        the hint (module docstring); both contiguous, of one dtype and shape."""
        stream = torch.cuda.current_stream(self.device)
        # Batched copies refuse the legacy default stream; the rows for this rank itself may
        # be copied there, off the overlapped path.
        if (self._copy_attributes is None or not self.prefer_copy_engine
                or stream.cuda_stream == 0
                or not (dst.is_contiguous() and src.is_contiguous())):
            dst.copy_(src)
            return
        size = dst.numel() * dst.element_size()
        result = self._cu.cuMemcpyBatchAsync(
            [self._cu.CUdeviceptr(dst.data_ptr())], [self._cu.CUdeviceptr(src.data_ptr())],
            [size], 1, [self._copy_attributes], [0], 1, self._cu.CUstream(stream.cuda_stream))
        if result[0] != self._cu.CUresult.CUDA_SUCCESS:
            # The copy was not queued: make it the plain way, and from now on always.
            warnings.warn(f"copy-engine all-to-all: cuMemcpyBatchAsync failed with {result[0]}; "
                          "copying with Tensor.copy_ from now on", RuntimeWarning, stacklevel=2)
            self._copy_attributes = None
            dst.copy_(src)

    def _check(self, error, what: str) -> None:
        if error != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"copy-engine all-to-all: {what} failed with {error}")

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   out: torch.Tensor | None = None,
                   index: torch.Tensor | None = None) -> torch.Tensor:
        """What :func:`sonic.distributed.comm.all_to_all` does, through peer memory: rows
        ``in_splits[j]`` of ``x`` (or of ``x[index]``: gathered straight into the send
        regions) to rank ``j``, ``out_splits[j]`` rows from rank ``j`` into ``out``. Queued
        on the current stream, which waits for it; the host never waits.

        Raises:
            RuntimeError: a message larger than the reserved regions (the caller reserves from
                the count exchange), or a driver call failing.
        """
        shape = tuple(x.shape[1:])
        row_bytes = x.element_size() * int(torch.Size(shape).numel())
        if out is None:
            out = x.new_empty((sum(out_splits),) + shape)
        me = self.ep_rank
        largest = max([n for j, n in enumerate(in_splits) if j != me]
                      + [n for j, n in enumerate(out_splits) if j != me], default=0)
        if largest * row_bytes > self.region_bytes:
            raise RuntimeError(f"copy-engine all-to-all: a message of {largest * row_bytes} "
                               f"bytes exceeds the reserved {self.region_bytes}")
        use = self._uses
        self._uses += 1
        slot, generation = use % _SLOTS, use // _SLOTS + 1
        send_at = [sum(in_splits[:j]) for j in range(self.ep_size)]
        recv_at = [sum(out_splits[:j]) for j in range(self.ep_size)]
        dtype = x.dtype

        def send_rows(j: int, dst: torch.Tensor) -> None:
            if in_splits[j]:
                part = slice(send_at[j], send_at[j] + in_splits[j])
                if index is None:
                    self._copy(dst, x[part])
                else:
                    torch.index_select(x, 0, index[part], out=dst)

        def region(rank: int, j: int, count: int) -> torch.Tensor:
            # Rank `rank`'s region for peer j: indexed by j's offset from it, 1 .. ep_size - 1.
            peer = (j - rank) % self.ep_size - 1
            return self._regions[rank][slot, peer, :count * row_bytes].view(dtype).view(
                (count,) + shape)

        current = torch.cuda.current_stream(self.device)
        send_rows(me, out[recv_at[me]:recv_at[me] + out_splits[me]])
        peers = [(me + step) % self.ep_size for step in range(1, self.ep_size)]
        # Two phases, joined on the current stream. A stream blocked in cuStreamWaitValue32
        # can hold up other streams that share its hardware queue; if a wait for a peer's
        # "ready" came before this rank's own "ready" signals, such a false dependency could
        # close a cycle over the ranks (one peer stream per rank, EP = 2, never has one). So
        # every "ready" is raised before any is awaited: phase 1 waits only on flags of
        # earlier calls.
        for j in peers:
            stream = self._streams[j]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._wait(stream, self._flag(me, 1, slot, j), generation - 1)
                send_rows(j, region(me, j, in_splits[j]))
                self._signal(stream, self._flag(j, 0, slot, me), generation)
        for j in peers:
            current.wait_stream(self._streams[j])
        for j in peers:
            stream = self._streams[j]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._wait(stream, self._flag(me, 0, slot, j), generation)
                if out_splits[j]:
                    self._copy(out[recv_at[j]:recv_at[j] + out_splits[j]],
                               region(j, me, out_splits[j]))
                self._signal(stream, self._flag(j, 1, slot, me), generation)
        for j in peers:
            current.wait_stream(self._streams[j])
        return out
