"""Shared GPU timing helpers for the kernel benchmarks.

``bench`` returns the median time of a callable in microseconds (triton's ``do_bench`` when
triton is installed, else CUDA events), after a warm-up that also absorbs JIT compilation.
``copy_bandwidth`` measures the device-to-device copy bandwidth in the same run, the ceiling that
bandwidth-bound kernels are compared against (ANCHORS.md: ≈ 3.02 TB/s read + write on H100).
"""

import statistics

import torch


def bench(fn, *, warmup: int = 10, rep_ms: int = 200) -> float:
    """Median time of ``fn()`` in microseconds on the current CUDA device.

    Runs ``fn`` ``warmup`` times first (compilation, allocator), then times it for about
    ``rep_ms`` milliseconds; the L2 cache is flushed between runs by ``do_bench``.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, int(rep_ms / max(start.elapsed_time(end), 1e-3)))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 127, (nbytes,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


def host_overhead_us(fn, calls: int = 2000) -> float:
    """Mean host time of one ``fn()`` call in microseconds (launch overhead, tiny inputs)."""
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_name() -> str:
    """Name of the current CUDA device, for the benchmark header."""
    return torch.cuda.get_device_name(torch.cuda.current_device())


def graph_us(fn) -> float:
    """Median µs of ``fn`` captured in a CUDA graph and replayed: device time without host overhead.

    Also checks that ``fn`` is graph-capturable (no host synchronisation).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)
