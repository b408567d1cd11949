"""GPU timing helpers shared by the benchmark suites: CUDA events around graph replays or eager calls, a cold L2
before every timed run, medians of many runs, and the two roofline ceilings measured on the same device.

Cold L2, clean: before each timed run a kernel *reads* a 256 MB buffer, so the L2 holds only clean lines of other
data. Flushing by writing (a memset, as Triton's ``do_bench`` does) leaves the L2 full of dirty lines whose write-back
the timed kernel then pays: on the H200 that added about 60 MB of write traffic (~14 us) to every memory-bound run
(`benchmarks/results/h200/flush.md`)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

_L2_FLUSH_BYTES = 256 << 20  # several times the H200's 60 MB L2


class Timer:
    """Times a zero-argument CUDA callable. Each timed run starts with a cold, clean L2 (a 256 MB read outside the
    timed region)."""

    def __init__(self, device: torch.device | str = "cuda", reps: int = 50, warmup: int = 5):
        self.device = torch.device(device)
        self.reps, self.warmup = reps, warmup
        self._flush = torch.zeros(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device=self.device)
        self._sink = torch.empty((), dtype=torch.float32, device=self.device)

    def flush_l2(self) -> None:
        """Evict the L2 by reading 256 MB (a sum): clean lines only, nothing left to write back."""
        torch.sum(self._flush, dim=0, out=self._sink)

    def _events(self, run: Callable[[], None]) -> float:
        times = []
        for _ in range(self.reps):
            self.flush_l2()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
        return statistics.median(times)

    def eager_us(self, fn: Callable[[], object]) -> float:
        """Median microseconds of one eager call (launch overhead included when the GPU waits on the host)."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        return self._events(fn)

    def graph_us(self, fn: Callable[[], object]) -> float:
        """Median microseconds of one CUDA-graph replay of ``fn`` (captured once after a warm-up)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return self._events(graph.replay)



def graph_calls_us(fn: Callable[[], object], calls: int = 20, replays: int = 5) -> float:
    """Microseconds per call of ``fn`` run ``calls`` times back to back in one CUDA graph, its inputs warm in L2 (as
    inside a captured draft step, where the producer has just written them): the median over ``replays``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)

def measure_peaks(device: torch.device | str = "cuda") -> dict[str, float]:
    """The two ceilings, measured here: device-to-device copy bandwidth (bytes read + written per second) and the
    dense bf16 matmul rate on random data."""
    timer = Timer(device, reps=20)
    n = 2 << 30  # 2 GiB copied: far beyond L2
    src = torch.randn(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    # the faster of a memcpy node and an SM elementwise copy kernel (graph-captured copy_ measured 2.8 TB/s here)
    copy_us = min(timer.graph_us(lambda: dst.copy_(src)), timer.graph_us(lambda: torch.mul(src, 1.0, out=dst)))
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    c = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    mm_us = timer.graph_us(lambda: torch.matmul(a, b, out=c))
    src = dst = None  # free the 4 GiB before the matmul
    return {
        "copy_bytes_per_s": 2 * n / (copy_us * 1e-6),
        "bf16_flops_per_s": 2 * size**3 / (mm_us * 1e-6),
    }


def roofline_us(bytes_moved: float, flops: float, peaks: dict[str, float]) -> float:
    """max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), in microseconds."""
    return max(bytes_moved / peaks["copy_bytes_per_s"], flops / peaks["bf16_flops_per_s"]) * 1e6
