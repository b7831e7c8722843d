"""The dispatch plan of an expert-parallel layer call: where every routed pair and token row
goes, built on the device with one count all-to-all and one host read (MetaShuffling, PyTorch
blog 2025: counts stay on the device, the host learns sizes once).

:func:`plan_dispatch` makes a :class:`DispatchPlan` (``C`` chunks of consecutive tokens, each a
:class:`DispatchChunk`); :mod:`sonic.distributed.experts` and :mod:`sonic.distributed.overlap`
move the data by it. The count message also carries the settings every rank must agree on
(:data:`_AGREED`), so a disagreement raises on every rank instead of hanging.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass

import torch

from sonic.activation_cache import ACTIVATION_CACHES
from sonic.experts.moe_experts import PRECISIONS
from sonic.distributed.comm import DTYPE_CODES, all_to_all, check_group, comm_device
from sonic.distributed.eplb import Placement
from sonic.nn.moe import ROUTERS
from sonic.routing.token_rounding import ROUNDINGS
from sonic.routing.topk import SCORES
from sonic.types import ACTIVATIONS, TRANSPORTS

# What every rank sends every other rank beside its counts; all ranks compare all entries, so
# a disagreement raises on every rank at once instead of hanging in the next collective. The
# settings of an expert-parallel layer come first (a bare ep_moe_experts call leaves them
# unset, -1): ranks that took different code paths (router, training mode) exchange messages
# of the same size, and the first setting that differs is the one that sent them apart.
_AGREED = ("router", "training", "top_k", "tile", "rounding", "score", "renormalize",
           "routed_scaling_factor", "n_group", "topk_group", "expert_bias", "bias_update_rate",
           "seq_aux_loss_coef", "z_loss_coef", "num_experts",
           "dtype of scores", "d (x.shape[1])", "n (w2_local.shape[2])",
           "dtype of x", "torch.is_grad_enabled()", "x.requires_grad", "scores.requires_grad",
           "w1_local.requires_grad", "w2_local.requires_grad",
           "placement (its fingerprint; 0 for the contiguous default)", "num_chunks",
           "recompute_dispatch", "precision", "activation_cache", "transport", "activation")
# How the named entries of _AGREED travel (an index into these) and are printed.
_BOOL = (False, True)
_AGREED_CODES = {"router": ROUTERS, "training": _BOOL, "rounding": ROUNDINGS, "score": SCORES,
                 "renormalize": _BOOL, "expert_bias": _BOOL, "dtype of scores": DTYPE_CODES, "dtype of x": DTYPE_CODES,
                 "torch.is_grad_enabled()": _BOOL, "x.requires_grad": _BOOL,
                 "scores.requires_grad": _BOOL, "w1_local.requires_grad": _BOOL,
                 "w2_local.requires_grad": _BOOL, "recompute_dispatch": _BOOL,
                 "precision": PRECISIONS, "activation_cache": ACTIVATION_CACHES,
                 "transport": TRANSPORTS, "activation": ACTIVATIONS}
# Float settings, sent as the int64 of their IEEE-754 bits (exact: ranks must agree bit for bit).
_FLOATS = ("routed_scaling_factor", "bias_update_rate", "seq_aux_loss_coef", "z_loss_coef")
# The value of a setting the caller did not give (a bare functional call).
_UNSET = -1
# The most chunks a layer call may pipeline (the count message has room for this many).
MAX_CHUNKS = 16
# Columns of the count message before the agreed settings: row and pair counts per chunk, the
# out-of-range flag, the sender's largest row and pair counts to one rank in one chunk.
_BAD, _LARGEST_ROWS, _LARGEST_PAIRS = 2 * MAX_CHUNKS, 2 * MAX_CHUNKS + 1, 2 * MAX_CHUNKS + 2
_HEADER = 2 * MAX_CHUNKS + 3


@dataclass(frozen=True)
class DispatchChunk:
    """One chunk of a :class:`DispatchPlan`: the send rows ``rows`` (a slice of
    :attr:`DispatchPlan.send_tokens`) and pairs ``pairs`` (a slice of
    :attr:`DispatchPlan.pair_order`) of the chunk's tokens.

    Receive side: ``recv_tokens (P_recv,)`` int32 — the row of the chunk's received rows that
    each received pair reads; ``recv_experts (P_recv,)`` int32 — its local expert (slot), in
    ``[0, E/ep)`` or ``[0, slots_per_rank)`` with a placement. Host split sizes, one per group
    rank: ``send_rows``, ``recv_rows``, ``send_pairs``, ``recv_pairs``.
    """

    rows: slice
    pairs: slice
    recv_tokens: torch.Tensor
    recv_experts: torch.Tensor
    send_rows: list[int]
    recv_rows: list[int]
    send_pairs: list[int]
    recv_pairs: list[int]


@dataclass(frozen=True)
class DispatchPlan:
    """Where rows and pairs go in one expert-parallel layer call; all indices on the device.

    This rank's ``T`` tokens are split into ``C`` chunks of ``L = ceil(T / C)`` consecutive
    tokens (chunk ``c``: tokens ``[c·L, min((c+1)·L, T))``, possibly empty; ``C = 1``: one chunk
    of all of them), one dispatch and one combine all-to-all each.

    Send side (this rank's ``T`` tokens and ``P`` pairs):
        send_tokens: ``(S,)`` int64 — source token of each send row; rows grouped by chunk,
            then by destination rank, tokens ascending within a rank.
        token_rows: ``(S,)`` int32 — send rows grouped by token (the combine's gather-sum
            index, as :attr:`RoutingMetadata.token_rows`).
        token_offsets: ``(T+1,)`` int32 — exclusive prefix sum of send rows per token.
        pair_order: ``(P,)`` int64 — pairs grouped by chunk, then by destination rank (stable).
    chunks: the ``C`` :class:`DispatchChunk` s, with the receive side and the host sizes.
    largest_rows, largest_pairs: the most rows / pairs any rank of the group sends any one
        rank in one chunk (the same on every rank): the largest message of the call.
    transport: what moves the data all-to-alls — ``None`` (``torch.distributed``) or a
        :class:`~sonic.distributed.peer.PeerTransport`.
    """

    send_tokens: torch.Tensor
    token_rows: torch.Tensor
    token_offsets: torch.Tensor
    pair_order: torch.Tensor
    chunks: tuple[DispatchChunk, ...]
    num_tokens: int
    group: object
    largest_rows: int = 0
    largest_pairs: int = 0
    transport: object = None

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   out: torch.Tensor | None = None,
                   index: torch.Tensor | None = None) -> torch.Tensor:
        """A data all-to-all of this plan (:func:`sonic.distributed.comm.all_to_all` over its
        group and transport)."""
        return all_to_all(x, out_splits, in_splits, self.group, out, index=index,
                          transport=self.transport)

    def save_for_backward(self, ctx, *tensors: torch.Tensor | None) -> None:
        """``ctx.save_for_backward(*tensors, <this plan's index tensors>)``, and the plan
        without them on ``ctx``: every tensor an EP autograd function keeps passes through
        autograd's saved-tensor hooks (``sonic.profile_activation_memory`` counts it,
        ``torch.autograd.graph.save_on_cpu`` offloads it). :meth:`saved` undoes it."""
        mine = [self.send_tokens, self.token_rows, self.token_offsets, self.pair_order,
                *(t for c in self.chunks for t in (c.recv_tokens, c.recv_experts))]
        ctx.save_for_backward(*tensors, *mine)
        # The plan kept on ctx holds no tensor; saved() puts them back.
        ctx.plan_without_tensors = (len(tensors), dataclasses.replace(
            self, send_tokens=None, token_rows=None, token_offsets=None,  # type: ignore[arg-type]
            pair_order=None,  # type: ignore[arg-type]
            chunks=tuple(dataclasses.replace(c, recv_tokens=None,  # type: ignore[arg-type]
                                             recv_experts=None)  # type: ignore[arg-type]
                         for c in self.chunks)))

    @staticmethod
    def saved(ctx) -> tuple[list[torch.Tensor], "DispatchPlan"]:
        """``(tensors, plan)`` as :meth:`save_for_backward` saved them."""
        count, plan = ctx.plan_without_tensors
        saved = ctx.saved_tensors
        send_tokens, token_rows, token_offsets, pair_order, *recv = saved[count:]
        chunks = tuple(dataclasses.replace(c, recv_tokens=recv[2 * i], recv_experts=recv[2 * i + 1])
                       for i, c in enumerate(plan.chunks))
        return list(saved[:count]), dataclasses.replace(
            plan, send_tokens=send_tokens, token_rows=token_rows, token_offsets=token_offsets,
            pair_order=pair_order, chunks=chunks)


def agreed_values(settings: Mapping[str, Any]) -> list[int]:
    """This rank's row of :data:`_AGREED` for the count exchange: each setting named in
    ``settings`` encoded as an int (strings, bools and dtypes as their index in
    :data:`_AGREED_CODES`), the others unset.

    Raises:
        ValueError: a name that is not in :data:`_AGREED`, or a value outside its codes.
    """
    unknown = sorted(set(settings) - set(_AGREED))
    if unknown:
        raise ValueError(f"unknown EP settings {unknown}; known: {', '.join(_AGREED)}")
    row = []
    for name in _AGREED:
        value = settings.get(name)
        if value is None:
            row.append(_UNSET)
        elif name in _AGREED_CODES:
            if value not in _AGREED_CODES[name]:
                raise ValueError(f"EP setting {name} must be one of {_AGREED_CODES[name]}, "
                                 f"got {value!r}")
            row.append(_AGREED_CODES[name].index(value))
        elif name in _FLOATS:
            row.append(struct.unpack("<q", struct.pack("<d", float(value)))[0])
        else:
            row.append(int(value))
    return row


def _send_counts(rows: torch.Tensor, pairs: torch.Tensor, bad: torch.Tensor,
                 agreed: list[int], group, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue the count all-to-all: to each group rank its row and pair counts per chunk
    (``rows``, ``pairs``: ``(ep, C)``, sent padded to ``MAX_CHUNKS``), the out-of-range flag
    ``bad``, the most rows and pairs this rank sends one rank in one chunk (so that every rank
    learns the largest message of the call: the copy-engine transport sizes its buffers by it)
    and ``agreed``. One message size whatever the caller, so ranks on different code paths
    still meet. Returns ``(sent, received)`` on the device; :func:`_read_counts` reads them.
    Nothing here waits for the device (``agreed`` travels through pinned memory)."""
    device = rows.device
    pad = (0, MAX_CHUNKS - rows.shape[1])
    largest = torch.stack([rows.max(), pairs.max()])           # rows, pairs: (ep, C), never empty
    settings = torch.tensor(agreed, dtype=torch.int64)
    settings = (settings.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                else settings.to(device))
    counts = torch.cat([torch.nn.functional.pad(rows, pad), torch.nn.functional.pad(pairs, pad),
                        bad.to(torch.int64).expand(ep_size, 1), largest.expand(ep_size, 2),
                        settings.expand(ep_size, -1)], dim=1)
    return counts, all_to_all(counts, [1] * ep_size, [1] * ep_size, group)


def _read_counts(counts: torch.Tensor, recv: torch.Tensor, agreed: list[int], ep_rank: int,
                 num_tokens: int, num_experts: int) -> tuple[list, list]:
    """The one host read of a count exchange: ``(sent, table)``, host lists of what this rank
    sent to and received from each rank; raises on every rank what :func:`_check_agreement`
    finds."""
    ep_size, width = counts.shape
    host = torch.cat([counts[:, :2 * MAX_CHUNKS].flatten(), recv.flatten()]).tolist()  # one sync
    sent = [host[j * 2 * MAX_CHUNKS:(j + 1) * 2 * MAX_CHUNKS] for j in range(ep_size)]
    table = host[ep_size * 2 * MAX_CHUNKS:]
    table = [table[j * width:(j + 1) * width] for j in range(ep_size)]
    _check_agreement(table, agreed, ep_rank, num_tokens, num_experts)
    return sent, table


def check_settings(settings: Mapping[str, object], group, device: torch.device) -> None:
    """Collective: raise on every rank of ``group`` unless all agree on ``settings`` (names of
    :data:`_AGREED`). It is a count exchange without counts — the message a layer's dispatch
    sends — so a rank that calls this while another dispatches meets it, and both name the
    setting that differs. ``device``: where the caller's tensors are.

    Raises:
        ValueError: ranks disagree (on every rank, naming the setting and each rank's value).
    """
    ep_size, ep_rank = check_group(group)
    device = comm_device(group, device)
    none = torch.zeros(ep_size, 1, dtype=torch.int64, device=device)
    agreed = agreed_values(settings)
    counts, recv = _send_counts(none, none, torch.zeros((), dtype=torch.bool, device=device),
                                agreed, group, ep_size)
    _read_counts(counts, recv, agreed, ep_rank, 0, 0)


def plan_dispatch(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int,
                  num_experts: int, agreed: list[int], group,
                  placement: Placement | None = None, num_chunks: int = 1,
                  transport=None) -> DispatchPlan:
    """Build the :class:`DispatchPlan` with one count all-to-all and one host read, for
    ``num_chunks`` chunks of ``ceil(T / num_chunks)`` consecutive tokens (the last ones
    shorter or empty).

    ``agreed`` holds this rank's values of :data:`_AGREED` (:func:`agreed_values`). ``placement``: where experts live
    (``None``: contiguous, expert ``e`` at local index ``e % (E/ep)`` of rank ``e // (E/ep)``).
    A pair's destination does not depend on the chunking (a replica is chosen from the token's
    index among all ``T``), so every chunk count sends every pair to the same expert.
    ``transport``: kept in the plan for its data all-to-alls (:attr:`DispatchPlan.transport`).

    Raises:
        ValueError: on every rank, if any rank's indices are out of range or ranks disagree on
            an entry of :data:`_AGREED`.
    """
    ep_size, ep_rank = check_group(group)
    num_local = num_experts // ep_size if placement is None else placement.slots_per_rank
    device = token_idx.device
    tokens, experts = token_idx.long(), expert_idx.long()
    # Out-of-range indices are reported collectively after the exchange; clamping keeps the
    # scatters below in bounds until then.
    bad = ((tokens < 0) | (tokens >= num_tokens) | (experts < 0) | (experts >= num_experts)).any()
    chunk_len = max(1, -(-num_tokens // num_chunks))
    width = num_chunks * chunk_len                             # >= T, padded to whole chunks
    tokens = tokens.clamp(0, max(num_tokens, 1) - 1)
    experts = experts.clamp(0, num_experts - 1)
    # The slot of each pair: its expert (contiguous) or one of the expert's replicas.
    slots = experts if placement is None else placement.pair_slots(tokens, experts, ep_rank)
    dst = slots // num_local
    chunk = tokens // chunk_len
    cell = dst * width + tokens                                # (rank, token), rank-major
    mark = torch.zeros(ep_size * width, dtype=torch.int64, device=device).scatter_(0, cell, 1)
    # Send rows in (chunk, rank, token) order, so that each chunk's rows are one contiguous
    # block, grouped by destination rank as its all-to-all wants them.
    blocks = mark.view(ep_size, num_chunks, chunk_len)
    row_of_cell = (torch.cumsum(blocks.transpose(0, 1).flatten(), 0) - 1).view(
        num_chunks, ep_size, chunk_len).transpose(0, 1).flatten()
    rows = blocks.sum(2)                                       # (ep, C)
    bucket = dst * num_chunks + chunk                          # (rank, chunk), rank-major
    pairs = torch.zeros(ep_size * num_chunks, dtype=torch.int64, device=device).scatter_add_(
        0, bucket, torch.ones_like(bucket)).view(ep_size, num_chunks)
    send_row = row_of_cell[cell]
    by_chunk = rows.t().flatten()
    block_start = (torch.cumsum(by_chunk, 0) - by_chunk).view(num_chunks, ep_size).t()
    # One int per pair for the receiver: its row within the block of its chunk sent to that
    # rank, and its local expert.
    info = (send_row - block_start[dst, chunk]) * num_local + (slots - dst * num_local)

    # Padded to MAX_CHUNKS chunks, so the message has the same size on every rank even when
    # ranks disagree on num_chunks (which the agreement check then reports).
    counts, recv = _send_counts(rows, pairs, bad, agreed, group, ep_size)
    # What needs no host size is queued before the host read, so that the device runs it
    # while the host waits instead of the host launching it while the device waits. Buffers
    # sized for the worst case (every cell a row) are cut to the real sizes afterwards.
    info_sent = info.index_select(0, torch.argsort(bucket, stable=True))   # (rank, chunk) order
    # Pairs of one (rank, token) cell share a row, so duplicate scatter indices write equal
    # values: the result is deterministic.
    send_tokens = torch.zeros(ep_size * width, dtype=torch.int64, device=device).scatter_(
        0, send_row, tokens)
    token_major = mark.view(ep_size, width).t()
    token_major_row = (torch.cumsum(token_major.flatten(), 0) - 1).view(width, ep_size).t()
    token_rows = torch.zeros(ep_size * width, dtype=torch.int32, device=device).scatter_(
        0, token_major_row.flatten()[cell], send_row.to(torch.int32))
    token_offsets = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    torch.cumsum(token_major.sum(1)[:num_tokens], 0, dtype=torch.int32, out=token_offsets[1:])
    pair_order = torch.argsort(chunk * ep_size + dst, stable=True)
    sent, table = _read_counts(counts, recv, agreed, ep_rank, num_tokens, num_experts)
    # [c][j]: chunk c, group rank j.
    send_rows = [[sent[j][c] for j in range(ep_size)] for c in range(num_chunks)]
    send_pairs = [[sent[j][MAX_CHUNKS + c] for j in range(ep_size)] for c in range(num_chunks)]
    recv_rows = [[table[j][c] for j in range(ep_size)] for c in range(num_chunks)]
    recv_pairs = [[table[j][MAX_CHUNKS + c] for j in range(ep_size)] for c in range(num_chunks)]

    # One exchange of the pair info for all chunks: it travels rank-major, (rank, chunk).
    recv_info = all_to_all(info_sent, [sum(p) for p in zip(*recv_pairs)],
                           [sum(p) for p in zip(*send_pairs)], group)
    num_recv = recv_info.numel()
    recv_rows_dev = recv[:, :num_chunks]                       # (source rank, chunk)
    recv_row_start = torch.cumsum(recv_rows_dev, 0) - recv_rows_dev
    source_chunk = torch.repeat_interleave(
        torch.arange(ep_size * num_chunks, device=device),
        recv[:, MAX_CHUNKS:MAX_CHUNKS + num_chunks].flatten(), output_size=num_recv)
    source, recv_chunk = source_chunk // num_chunks, source_chunk % num_chunks
    recv_tokens = (recv_row_start[source, recv_chunk] + recv_info // num_local).to(torch.int32)
    recv_experts = (recv_info % num_local).to(torch.int32)
    if num_chunks > 1:
        # Chunk-major, source rank next: each chunk's pairs in the order of its row blocks.
        order = torch.argsort(recv_chunk, stable=True)
        recv_tokens, recv_experts = recv_tokens[order], recv_experts[order]
    num_send = sum(map(sum, send_rows))
    send_tokens, token_rows = send_tokens[:num_send], token_rows[:num_send]

    chunks, row, pair, recv_pair = [], 0, 0, 0
    for c in range(num_chunks):
        num_rows, num_pairs, num_recv_pairs = sum(send_rows[c]), sum(send_pairs[c]), \
            sum(recv_pairs[c])
        received = slice(recv_pair, recv_pair + num_recv_pairs)
        chunks.append(DispatchChunk(
            rows=slice(row, row + num_rows), pairs=slice(pair, pair + num_pairs),
            recv_tokens=recv_tokens[received], recv_experts=recv_experts[received],
            send_rows=send_rows[c], recv_rows=recv_rows[c], send_pairs=send_pairs[c],
            recv_pairs=recv_pairs[c]))
        row, pair, recv_pair = row + num_rows, pair + num_pairs, recv_pair + num_recv_pairs
    return DispatchPlan(
        send_tokens=send_tokens, token_rows=token_rows, token_offsets=token_offsets,
        pair_order=pair_order, chunks=tuple(chunks),
        num_tokens=num_tokens, group=group,
        largest_rows=max(row[_LARGEST_ROWS] for row in table),
        largest_pairs=max(row[_LARGEST_PAIRS] for row in table), transport=transport)


def _check_agreement(table: list[list[int]], agreed: list[int], ep_rank: int, num_tokens: int,
                     num_experts: int) -> None:
    """``table[j]``: what group rank ``j`` sent — ``2·MAX_CHUNKS`` counts, its out-of-range
    flag, its largest counts, then its values of :data:`_AGREED`. The message names the first
    setting that differs and every rank's value of it, the same on every rank."""
    for source, row in enumerate(table):
        if row[_BAD]:
            where = "this rank" if source == ep_rank else f"EP rank {source}"
            raise ValueError(f"token_idx/expert_idx out of range on {where}: token_idx must be "
                             f"in [0, T) and expert_idx in [0, num_experts={num_experts}) on "
                             f"every rank (this rank has T={num_tokens})")
    for index, name in enumerate(_AGREED):
        values = [row[_HEADER + index] for row in table]
        if len(set(values)) > 1:
            ranks: dict[int, list[int]] = {}
            for source, value in enumerate(values):
                ranks.setdefault(value, []).append(source)
            found = "; ".join(f"{_decode(name, value)} on EP rank{'s' if len(r) > 1 else ''} "
                              f"{', '.join(map(str, r))}" for value, r in ranks.items())
            raise ValueError(f"EP ranks disagree on {name}: {found} (this rank is {ep_rank}, "
                             f"it has {_decode(name, agreed[index])}); every rank of the group "
                             f"must use the same {name}")


def _decode(name: str, value: int) -> str:
    """How a value of setting ``name`` is printed."""
    if value == _UNSET:
        return "unset"
    if name in _FLOATS:
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    codes = _AGREED_CODES.get(name)
    return repr(codes[value]) if codes is not None and 0 <= value < len(codes) else str(value)
