"""Shared GPU timing helpers for the kernel benchmarks.

``bench`` returns the median time of a callable in microseconds (triton's ``do_bench`` when
triton is installed, else CUDA events), after a warm-up that also absorbs JIT compilation.
``copy_bandwidth`` measures the device-to-device copy bandwidth in the same run, the ceiling that
bandwidth-bound kernels are compared against (≈ 3.02 TB/s read + write on H100).
"""

import statistics
import time

import torch


# Timed repetitions a median takes at least: a 27 ms training step gets 7 in a 200 ms window,
# and the median of 7 moved by 10% between repeated timings of one step in one process
# (H200; benchmarks/RESULTS.md, "Timing").
MIN_REPS = 25


def rep_window_ms(estimate_ms: float, rep_ms: float, min_reps: int = MIN_REPS) -> float:
    """The timing window for a callable of ``estimate_ms``: ``rep_ms``, widened so that it
    holds at least ``min_reps`` calls (``do_bench`` times as many calls as fit its window).

    Raises:
        ValueError: ``estimate_ms`` is negative, or ``rep_ms`` or ``min_reps`` not positive.
    """
    if estimate_ms < 0 or rep_ms <= 0 or min_reps <= 0:
        raise ValueError(f"need estimate_ms >= 0, rep_ms > 0 and min_reps > 0, got "
                         f"{estimate_ms}, {rep_ms}, {min_reps}")
    return max(rep_ms, min_reps * estimate_ms)


def bench(fn, *, warmup: int = 10, rep_ms: int = 200, grad_to_none=None) -> float:
    """Median time of ``fn()`` in microseconds on the current CUDA device.

    Runs ``fn`` ``warmup`` times first (compilation, allocator), then times it over at least
    ``rep_ms`` milliseconds and :data:`MIN_REPS` calls (:func:`rep_window_ms`); the L2 cache is
    flushed between runs by ``do_bench``, and the ``.grad`` of every tensor in
    ``grad_to_none`` is set to None before each run, outside the timed region (a training step
    as docs/design.md §5 times it).
    """
    for _ in range(warmup):
        _drop_grads(grad_to_none)
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _drop_grads(grad_to_none)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end)
    window_ms = rep_window_ms(estimate_ms, rep_ms)
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=25, rep=window_ms, return_mode="median",
                        grad_to_none=grad_to_none) * 1e3
    reps = max(5, int(window_ms / max(estimate_ms, 1e-3)))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps):
        _drop_grads(grad_to_none)
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3


def _drop_grads(tensors) -> None:
    for t in tensors or ():
        t.grad = None


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 127, (nbytes,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


def host_overhead_us(fn, calls: int = 2000) -> float:
    """Mean host time of one ``fn()`` call in microseconds (launch overhead, tiny inputs)."""
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


def captured(fn, warmups: int = 3):
    """``fn`` captured in a CUDA graph: the graph's replay, after ``warmups`` calls on a side
    stream (kernels compiled, allocator warm), as capture requires. Capture fails if ``fn``
    synchronises with the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_us(fn) -> float:
    """Median µs of ``fn`` captured in a CUDA graph and replayed: device time without host overhead.

    Also checks that ``fn`` is graph-capturable (no host synchronisation).
    """
    return bench(captured(fn))


def nvml_handle(nvml, props):
    """The NVML handle of the GPU whose torch properties are ``props``
    (``torch.cuda.get_device_properties``), found by its UUID, else by its PCI bus id.

    Not by index: CUDA numbers the devices that ``CUDA_VISIBLE_DEVICES`` leaves visible, NVML
    all of the machine's, so torch's device 0 in a job given GPU 1 is NVML's device 1.

    Raises:
        LookupError: no NVML device has the UUID or the bus id (the message says what was
            tried), rather than sampling another GPU.
    """
    tried = []
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        try:
            return nvml.nvmlDeviceGetHandleByUUID(name)
        except Exception as err:  # noqa: BLE001 - NVML's error classes vary by binding
            tried.append(f"UUID {name} ({err})")
    if getattr(props, "pci_bus_id", None) is not None:
        bus_id = (f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:"
                  f"{getattr(props, 'pci_device_id', 0):02x}.0")
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception as err:  # noqa: BLE001
            tried.append(f"PCI bus id {bus_id} ({err})")
    raise LookupError(f"no NVML device matches torch's {getattr(props, 'name', 'GPU')}: tried "
                      + ("; ".join(tried) or "nothing (the properties have no UUID or bus id)"))


class PowerSampler:
    """SM clock and board power of the current GPU, sampled every 10 ms in a thread while the
    ``with`` block runs (NVML through ``pynvml``; no samples where it is missing).

    ``summary()`` gives the median SM clock (MHz), the mean power (W), the energy the board
    used in the block (J, from NVML's energy counter) and the throttle reasons seen (NVML's
    bit mask: 0x4 is the software power cap, 0x20/0x40 thermal slowdown). The mean power is
    that energy over the block's wall time; only a board without an energy counter gets the
    mean of NVML's power readings, which trail the load (on the H200 about 530 W read during
    one-second GEMM loops whose energy gave 700 W). The GPU is torch's current device, found in
    NVML by :func:`nvml_handle`; :attr:`unavailable` says why there are no samples, if so.
    """

    def __init__(self, period_s: float = 0.01):
        self.period_s = period_s
        self.samples: list[tuple[int, float, int]] = []
        self._stop = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = nvml_handle(pynvml, torch.cuda.get_device_properties(
                torch.cuda.current_device()))
            self._nvml = pynvml
            self.unavailable = None
        except Exception as err:  # noqa: BLE001 - pynvml missing or NVML unusable: no samples
            self._nvml = None
            self.unavailable = f"{type(err).__name__}: {err}"

    def _energy_mj(self) -> int | None:
        if self._nvml is None:
            return None
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception:  # noqa: BLE001 - not every board reports energy
            return None

    def _run(self):
        nv = self._nvml
        while not self._stop:
            self.samples.append((nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM),
                                 nv.nvmlDeviceGetPowerUsage(self._handle) / 1e3,
                                 nv.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle)))
            time.sleep(self.period_s)

    def __enter__(self):
        import threading

        self._energy0 = self._energy_mj()
        self._t0 = time.perf_counter()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self._stop = True
        if self._nvml is not None:
            self._thread.join()
        end = self._energy_mj()
        self.seconds = time.perf_counter() - self._t0
        self.energy_j = None if end is None or self._energy0 is None else (end - self._energy0) / 1e3

    def summary(self) -> dict:
        """``{"sm_mhz", "watts", "energy_J", "throttle"}``; None values without samples."""
        if not self.samples:
            return {"sm_mhz": None, "watts": None, "energy_J": None, "throttle": None}
        clocks = sorted(s[0] for s in self.samples)
        reasons = 0
        for s in self.samples:
            reasons |= s[2]
        watts = (statistics.fmean(s[1] for s in self.samples) if self.energy_j is None
                 else self.energy_j / self.seconds)
        return {"sm_mhz": clocks[len(clocks) // 2], "watts": watts,
                "energy_J": self.energy_j, "throttle": hex(reasons)}


def energy_per_call(fn, *, seconds: float = 1.0, grad_to_none=None) -> dict:
    """Run ``fn`` back to back for about ``seconds`` under a :class:`PowerSampler`; its summary
    plus ``"J_per_call"`` (board energy over the calls) and ``"calls"``."""
    torch.cuda.synchronize()
    calls, t0 = 0, time.perf_counter()
    with PowerSampler() as power:
        while time.perf_counter() - t0 < seconds:
            _drop_grads(grad_to_none)
            fn()
            calls += 1
            if calls % 4 == 0:
                torch.cuda.synchronize()
    stats = power.summary()
    stats["calls"] = calls
    stats["J_per_call"] = None if stats["energy_J"] is None else stats["energy_J"] / calls
    return stats


def trace_idle(fn, path: str, *, steps: int = 6, grad_to_none=None) -> list[dict]:
    """Profile ``steps`` consecutive calls of ``fn`` (CPU and CUDA activity, L2 flushed before
    each as in :func:`bench`), write the Chrome trace to ``path`` and return, per call, the span
    from its first to its last GPU kernel, the kernels' summed time, the GPU idle time between
    them and the largest idle gap with the kernel that ended it — what the GPU waited on the
    host for."""
    import json

    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(2):
        _drop_grads(grad_to_none)
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _drop_grads(grad_to_none)
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    # A call begins after its flush, the only fill of int8 elements.
    flushes = [i for i, e in enumerate(gpu)
               if "FillFunctor<signed char>" in e["name"]]
    rows = []
    for a, b in zip(flushes, flushes[1:] + [len(gpu)]):
        kernels = gpu[a + 1:b]
        if not kernels:
            continue
        span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
        busy = sum(k["dur"] for k in kernels)
        gaps = [(nxt["ts"] - prev["ts"] - prev["dur"], nxt["name"])
                for prev, nxt in zip(kernels, kernels[1:])]
        worst = max(gaps, default=(0.0, ""))
        rows.append({"span_us": span, "busy_us": busy, "idle_us": span - busy,
                     "kernels": len(kernels), "largest_gap_us": worst[0],
                     "gap_before": worst[1][:60]})
    return rows
