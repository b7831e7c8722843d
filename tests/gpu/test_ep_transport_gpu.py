"""The copy-engine transport of expert parallelism on 2 (and, where the host has them, 4) GPUs
over NCCL (skipped with fewer than two GPUs).

Spawned ranks check :class:`sonic.distributed.peer.PeerTransport` against NCCL's
``all_to_all_single``, which moves the same bytes, so every comparison is bitwise:

* ragged random splits (zeros included: a rank sending nothing to a peer, a rank receiving
  nothing), rows of bf16 ``(·, 384)``, fp32 scores ``(·,)`` and int64 ``(·, 3)``, sent as
  given and gathered by an index, copies made with the copy-engine hint and without; 24
  all-to-alls back to back with no host synchronisation
  (every slot and generation of the flags used many times), then one that outgrows the
  reserved regions after ``reserve`` grew them;
* the EP layer with ``transport="copy_engine"`` for ``C = 1`` and ``C = 2``: output and every
  gradient bitwise those of ``transport="nccl"``; ``"auto"`` picks the copy engines here;
* the same chunked step five times back to back: bitwise the same every time (stream safety).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from nccl_ranks import init_rank, spawn, step  # noqa: E402

T, D, N, E, K = 1536, 512, 256, 16, 4


def _splits(world, g, device, high):
    """A random (world, world) matrix of row counts, about a quarter of them zero."""
    counts = torch.randint(0, high, (world, world), generator=g, device=device)
    return counts * (torch.rand((world, world), generator=g, device=device) > 0.25)


def _rank(rank, world, port, tmp):
    import sonic
    from sonic.distributed import ExpertParallelMoE
    from sonic.distributed.peer import peer_transport

    device = init_rank(rank, world, port)
    result = {}
    transport = peer_transport(None, device)
    g = torch.Generator(device).manual_seed(7)        # the same splits on every rank
    mine = torch.Generator(device).manual_seed(100 + rank)
    shapes = [((384,), torch.bfloat16), ((), torch.float32), ((3,), torch.int64)]
    sent, expected = [], []
    transport.reserve(2048 * 384 * 2)
    for i in range(24):
        row, dtype = shapes[i % 3]
        counts = _splits(world, g, device, 2048).tolist()
        in_splits, out_splits = counts[rank], [counts[j][rank] for j in range(world)]
        rows = sum(in_splits)
        source = torch.randn((rows + 5,) + row, generator=mine, device=device).mul(100)
        source = source.to(dtype)
        index = torch.randperm(rows + 5, generator=mine, device=device)[:rows] \
            if i % 2 else None
        send = source if index is None else source[index]
        send = send[:rows]
        # Copies with the copy-engine hint and through Tensor.copy_, in turn.
        transport.prefer_copy_engine = i % 4 < 2
        reference = send.new_empty((sum(out_splits),) + row)
        dist.all_to_all_single(reference, send.contiguous(), out_splits, in_splits)
        sent.append(transport.all_to_all(source[:rows] if index is None else source,
                                         out_splits, in_splits, index=index))
        expected.append(reference)
    # Outgrow the regions: reserve (collectively) more, then a message that needs it.
    big = 3 * transport.region_bytes // (384 * 2)
    transport.reserve(big * 384 * 2)
    transport.prefer_copy_engine = True
    send = torch.randn(world * big, 384, generator=mine, device=device).to(torch.bfloat16)
    reference = torch.empty_like(send)
    dist.all_to_all_single(reference, send, [big] * world, [big] * world)
    sent.append(transport.all_to_all(send, [big] * world, [big] * world))
    expected.append(reference)
    torch.cuda.synchronize()
    result["a2a_bitwise"] = [torch.equal(a, b) for a, b in zip(sent, expected)]

    torch.manual_seed(0)
    full = sonic.MoE(D, N, E, K, device=device, dtype=torch.bfloat16)
    gx = torch.Generator(device).manual_seed(1)
    x_full = torch.randn(world * T, D, device=device, dtype=torch.bfloat16, generator=gx)
    dout_full = torch.randn(world * T, D, device=device, dtype=torch.bfloat16, generator=gx)
    part = slice(rank * T, (rank + 1) * T)
    layer = ExpertParallelMoE.from_moe(full)
    runs = {}
    for c in (1, 2):
        layer.num_chunks = c
        for t in ("nccl", "copy_engine"):
            layer.transport = t
            runs[(c, t)] = step(layer, x_full[part], dout_full[part])
        result[f"layer_bitwise_C{c}"] = all(
            torch.equal(a, b) for a, b in zip(runs[(c, "copy_engine")], runs[(c, "nccl")]))
    layer.transport = "auto"
    auto = step(layer, x_full[part], dout_full[part])
    result["auto_bitwise"] = all(torch.equal(a, b) for a, b in zip(auto, runs[(2, "nccl")]))
    layer.transport = "copy_engine"
    repeats = [step(layer, x_full[part], dout_full[part]) for _ in range(5)]
    torch.cuda.synchronize()
    result["repeat_bitwise"] = all(torch.equal(a, b) for r in repeats
                                   for a, b in zip(r, runs[(2, "nccl")]))
    dist.destroy_process_group()
    torch.save(result, f"{tmp}/rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_transport(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    spawn(_rank, world, tmp_path)
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(r["a2a_bitwise"]), (rank, r)
        assert r["layer_bitwise_C1"] and r["layer_bitwise_C2"], (rank, r)
        assert r["auto_bitwise"] and r["repeat_bitwise"], (rank, r)
