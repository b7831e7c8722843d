"""Bitonic top-K router kernel vs ``torch.topk`` + softmax, same run, same inputs.

    python benchmarks/bench_topk.py [--T 32768] [--K 8] [--E 128 64 256] [--dtype bfloat16]

Times ``sonic.kernels.topk.topk_scores(logits, K)`` (score ``softmax_topk``) against what a
PyTorch router does today (``torch.topk``, then ``softmax`` of the K values in fp32). Per E it
prints the median µs of both (``_timing.bench``: L2 flushed before every call, so logits come from
HBM; each call also pays its host launch cost when that exceeds the flush), the kernel's
logits-read GB/s and its percentage of the same-run device copy bandwidth (read + write of 1 GiB;
targets on H100: ≥ 60 %, and ≥ 3x torch), the speedup; then the same when calls run back to back
from a CUDA graph (device time only, inputs rotating over more than the L2 cache), with the
kernel's GB/s also against same-size copies run the same way; and the host time per eager call.

    python benchmarks/bench_topk.py --score sigmoid --E 256 --n-group 8 --topk-group 4 \
        --keys-per-lane 16 32 64

times DeepSeek-V3's router instead (sigmoid scores, a random selection bias, renormalised,
group-limited): the kernel against sonic's torch path (``sonic.reference.ops.scored_topk``),
after checking that both select the same experts; ``--keys-per-lane`` sweeps the 64-bit-key
plans' keys per lane (default 32).
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import bench, copy_bandwidth, device_name, host_overhead_us  # noqa: E402

from sonic.kernels import runtime, topk  # noqa: E402
from sonic.kernels.topk import topk_scores  # noqa: E402

ROTATE_BYTES = 256 << 20  # back-to-back timing rotates inputs over this many bytes (> L2)


def torch_router(logits: torch.Tensor, k: int):
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.softmax(values.float(), dim=-1), indices


def back_to_back_us(fn, n_calls: int, reps: int = 10) -> float:
    """Median device time per call of ``fn(0) … fn(n_calls - 1)`` replayed from one CUDA graph."""
    for i in range(n_calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    return statistics.median(times)


def run(T: int, E: int, K: int, dtype: torch.dtype, copy_gbps: float) -> dict:
    nbytes = T * E * torch.empty((), dtype=dtype).element_size()
    n_inputs = max(4, -(-ROTATE_BYTES // nbytes))
    g = torch.Generator(device="cuda").manual_seed(E)
    inputs = [torch.randn(T, E, device="cuda", generator=g).to(dtype) for _ in range(n_inputs)]
    logits = inputs[0]

    # Same experts and scores as the torch path (up to the order of exactly tied logits).
    scores, idx = topk_scores(logits, K)
    ref_scores, ref_idx = torch_router(logits, K)
    torch.testing.assert_close(scores.sort(dim=-1).values, ref_scores.sort(dim=-1).values,
                               rtol=1e-5, atol=1e-7)

    copies = [torch.empty_like(x) for x in inputs]
    kernel_b2b_us = back_to_back_us(lambda i: topk_scores(inputs[i], K), n_inputs)
    copy_b2b_us = back_to_back_us(lambda i: copies[i].copy_(inputs[i]), n_inputs)
    del copies
    kernel_us = bench(lambda: topk_scores(logits, K))
    one_row = logits[:1]  # host time: the launch path of a one-token call
    torch_us = bench(lambda: torch_router(logits, K))
    read_gbps = nbytes / (kernel_us * 1e-6) / 1e9
    return {
        "T": T, "E": E, "K": K, "dtype": str(dtype).removeprefix("torch."),
        "kernel_us": kernel_us, "torch_us": torch_us, "speedup": torch_us / kernel_us,
        "logits_read_gbps": read_gbps, "copy_gbps": copy_gbps,
        "pct_of_copy": 100 * read_gbps / copy_gbps,
        "kernel_b2b_us": kernel_b2b_us,
        "torch_b2b_us": back_to_back_us(lambda i: torch_router(inputs[i], K), n_inputs),
        "copy_b2b_us": copy_b2b_us,
        "b2b_read_gbps": nbytes / (kernel_b2b_us * 1e-6) / 1e9,
        # Same-size copies back to back: the ceiling at this size (launch and ramp included).
        "b2b_pct_of_same_size_copy": 100 * (nbytes / kernel_b2b_us) / (2 * nbytes / copy_b2b_us),
        "kernel_host_us": host_overhead_us(lambda: topk_scores(one_row, K)),
    }


def sweep_keys_per_lane(T: int, E: int, K: int, dtype: torch.dtype, choices) -> dict:
    """Back-to-back µs per call for each keys-per-lane choice (the kernel's one tuning knob)."""
    nbytes = T * E * torch.empty((), dtype=dtype).element_size()
    n_inputs = max(4, -(-ROTATE_BYTES // nbytes))
    inputs = [torch.randn(T, E, device="cuda").to(dtype) for _ in range(n_inputs)]
    out = {}
    for v in choices:
        out[v] = back_to_back_us(lambda i: topk._run(inputs[i], K, "softmax_topk", False, True, v),
                                 n_inputs)
    return out


def run_sigmoid(T: int, E: int, K: int, dtype: torch.dtype, n_group: int, topk_group: int,
                keys_per_lane) -> dict:
    """The sigmoid + bias + groups kernel against the torch path: equal selection, then
    median µs of both (L2 flushed), and back-to-back µs per keys-per-lane choice."""
    from sonic.reference.ops import scored_topk

    g = torch.Generator(device="cuda").manual_seed(E)
    logits = torch.randn(T, E, device="cuda", generator=g).to(dtype)
    bias = 0.01 * torch.randn(E, device="cuda", generator=g)
    kw = dict(score="sigmoid", renormalize=True, expert_bias=bias, n_group=n_group,
              topk_group=topk_group)
    scores, idx = topk_scores(logits, K, **kw)
    ref_scores, ref_idx = scored_topk(logits, K, "sigmoid", True, bias, n_group, topk_group)
    assert torch.equal(idx, ref_idx), "the kernel selects other experts than the torch path"
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-7)
    kernel_us = bench(lambda: topk_scores(logits, K, **kw))
    torch_us = bench(lambda: scored_topk(logits, K, "sigmoid", True, bias, n_group, topk_group))
    n_inputs = max(4, -(-ROTATE_BYTES // logits.nbytes))
    inputs = [torch.randn_like(logits) for _ in range(n_inputs)]
    b2b = {v: back_to_back_us(lambda i: topk._run(
        inputs[i], K, "sigmoid", True, True, v, expert_bias=bias, n_group=n_group,
        topk_group=topk_group), n_inputs) for v in keys_per_lane}
    return {"T": T, "E": E, "K": K, "dtype": str(dtype).removeprefix("torch."),
            "n_group": n_group, "topk_group": topk_group, "kernel_us": kernel_us,
            "torch_us": torch_us, "speedup": torch_us / kernel_us, "keys_per_lane_b2b_us": b2b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--K", type=int, default=8)
    parser.add_argument("--E", type=int, nargs="+", default=[128, 64, 256])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--keys-per-lane", type=int, nargs="*", default=[],
                        help="also time these keys-per-lane choices back to back (tuning)")
    parser.add_argument("--score", choices=("softmax_topk", "sigmoid"), default="softmax_topk",
                        help="sigmoid: DeepSeek-V3's router (bias, renormalised, groups)")
    parser.add_argument("--n-group", type=int, default=8, help="groups (--score sigmoid)")
    parser.add_argument("--topk-group", type=int, default=4, help="kept groups (--score sigmoid)")
    args = parser.parse_args()
    if args.score == "sigmoid":
        rows = [run_sigmoid(args.T, E, args.K, getattr(torch, args.dtype), args.n_group,
                            args.topk_group, args.keys_per_lane or [topk._KEYS_PER_LANE_WIDE])
                for E in args.E]
        for r in rows:
            print(f"T={r['T']} E={r['E']} K={r['K']} {r['dtype']} groups {r['n_group']}/"
                  f"{r['topk_group']}: torch path {r['torch_us']:.1f} us, kernel "
                  f"{r['kernel_us']:.1f} us ({r['speedup']:.1f}x); back to back by keys per "
                  "lane: " + "  ".join(f"{v}: {us:.2f} us"
                                      for v, us in r["keys_per_lane_b2b_us"].items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name(), "torch": torch.__version__, "rows": rows},
                          f, indent=1)
        return

    copy = copy_bandwidth()
    launch = "TVM-FFI" if runtime.tvm_ffi_enabled() else "plain"
    print(f"device: {device_name()}; copy bandwidth {copy:.0f} GB/s (read + write); "
          f"launcher: {launch}")
    print(f"{'T':>6} {'E':>4} {'K':>2} {'dtype':>8} | {'torch us':>8} {'kernel us':>9} "
          f"{'read GB/s':>9} "
          f"{'% copy':>6} {'speedup':>7} | {'b2b torch':>9} {'b2b kernel':>10} {'GB/s':>5} "
          f"{'% copy':>6} {'speedup':>7} {'% same-size copy':>16} | {'host us':>7}")
    rows = []
    for E in args.E:
        r = run(args.T, E, args.K, getattr(torch, args.dtype), copy)
        rows.append(r)
        print(f"{r['T']:>6} {r['E']:>4} {r['K']:>2} {r['dtype']:>8} | {r['torch_us']:>8.1f} "
              f"{r['kernel_us']:>9.1f} {r['logits_read_gbps']:>9.0f} {r['pct_of_copy']:>5.1f}% "
              f"{r['speedup']:>6.2f}x | {r['torch_b2b_us']:>9.1f} {r['kernel_b2b_us']:>10.2f} "
              f"{r['b2b_read_gbps']:>5.0f} {100 * r['b2b_read_gbps'] / copy:>5.1f}% "
              f"{r['torch_b2b_us'] / r['kernel_b2b_us']:>6.1f}x "
              f"{r['b2b_pct_of_same_size_copy']:>15.1f}% | "
              f"{r['kernel_host_us']:>7.1f}")
    sweeps = {}
    if args.keys_per_lane:
        print("back-to-back µs per call by keys per lane:", " ".join(map(str, args.keys_per_lane)))
        for E in args.E:
            sweeps[E] = sweep_keys_per_lane(args.T, E, args.K, getattr(torch, args.dtype),
                                            args.keys_per_lane)
            print(f"  E={E:>4}: " + "  ".join(f"{v}: {us:.2f}" for v, us in sweeps[E].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(), "torch": torch.__version__, "rows": rows,
                       "keys_per_lane_us": sweeps}, f, indent=1)


if __name__ == "__main__":
    main()
