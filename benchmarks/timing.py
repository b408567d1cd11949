"""GPU timing helpers shared by the benchmark suites: CUDA events around graph replays or eager calls, a cold L2
before every timed run, medians of many runs, and the two roofline ceilings measured on the same device."""
from __future__ import annotations

import statistics
from typing import Callable

import torch

_L2_FLUSH_BYTES = 256 << 20  # several times the H200's 60 MB L2


class Timer:
    """Times a zero-argument CUDA callable. Each timed run starts with a cold L2 (a 256 MB memset outside the
    timed region), as flash-attention's and Triton's benchmarks do."""

    def __init__(self, device: torch.device | str = "cuda", reps: int = 50, warmup: int = 5):
        self.device = torch.device(device)
        self.reps, self.warmup = reps, warmup
        self._flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=self.device)

    def _events(self, run: Callable[[], None]) -> float:
        times = []
        for _ in range(self.reps):
            self._flush.zero_()
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
    del src, dst
    return {
        "copy_bytes_per_s": 2 * n / (copy_us * 1e-6),
        "bf16_flops_per_s": 2 * size**3 / (mm_us * 1e-6),
    }


def roofline_us(bytes_moved: float, flops: float, peaks: dict[str, float]) -> float:
    """max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), in microseconds."""
    return max(bytes_moved / peaks["copy_bytes_per_s"], flops / peaks["bf16_flops_per_s"]) * 1e6
