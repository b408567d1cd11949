"""CUDA-graph capture for the decoding loop: one warm-up-and-capture helper and a static-input wrapper around it.

A round of speculative decoding is hundreds of small kernels; launched from Python each costs tens of microseconds
of host time, replayed from a graph about one. Everything the decoder replays (the target's decode and verify
forwards with :class:`CapturedCall`, a drafter's ``propose`` with :class:`CapturedDraft`, the round's tail) is
captured with :func:`capture`. Benchmarks use it too, so what they time is what the decoder runs.
"""
from __future__ import annotations

import gc
import time
from typing import Callable, Generic, Optional, Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def capture(
    fn: Callable[[], T],
    warmup: int = 2,
    reset: Optional[Callable[[], None]] = None,
    generators: Sequence[torch.Generator] = (),
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture one call of ``fn`` as a CUDA graph; returns ``(graph, fn's output)``.

    ``fn`` runs ``warmup`` times first on a side stream, so that Triton compiles and autotunes, torch.compile
    traces, and the caching allocator grows outside the capture (none of them can happen inside one). The warm-up
    calls execute for real: ``reset`` (if given) runs before each of them and before the capture, to undo what a
    call mutates. The output's tensors are the graph's static outputs: every ``replay()`` rewrites them in place.
    ``generators`` are the torch.Generators ``fn`` draws from (the default CUDA generator needs no mention); each
    replay then advances them like an eager call would.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if reset is not None:
                reset()
            fn()
        if reset is not None:
            reset()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        graph.register_generator_state(gen)
    # A torch.compile'd fn compiled during the warm-up; compiling again inside the capture cannot work (Inductor
    # reads values back from the device), so a recompile there is an error with its reason, not a broken capture.
    # Two guards against CUDA calls that are not ours invalidating the capture (seen on the H200 as
    # cudaErrorStreamCaptureInvalidated at random points of a draft capture, after earlier decoders of the same
    # process had been dropped; the cause is not pinned down): thread-local capture mode, so another thread's
    # synchronising call cannot break it, and no cyclic garbage collection inside the capture, so no destructor of
    # a dropped decoder's graphs, events or memory runs in the middle of it (torch.cuda.graph collects just before).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with (torch.compiler.set_stance("fail_on_recompile"),
              torch.cuda.graph(graph, capture_error_mode="thread_local")):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class CapturedCall(Generic[T]):
    """``fn(*inputs)`` replayed from one CUDA graph per input signature (shapes and dtypes).

    Each call copies the inputs into the graph's static input tensors, replays, and returns the static output
    (overwritten by the next call). ``fn`` must read everything else from tensors that outlive the graph (a KV
    cache, a decoding state) and may mutate them only where its warm-up calls (see :func:`capture`) do no harm.
    """

    def __init__(self, fn: Callable[..., T], generators: Sequence[torch.Generator] = ()) -> None:
        self.fn = fn
        self.generators = tuple(generators)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], T]] = {}
        self.capture_s = 0.0  # wall seconds spent capturing (warm-up runs included)

    def capture(self, *inputs: Tensor) -> None:
        """Capture the graph for these inputs' signature now (a no-op when it exists); ``inputs`` seed the static
        inputs of the warm-up runs."""
        key = _signature(inputs)
        if key not in self._graphs:
            static = [t.clone() for t in inputs]
            (graph, out), seconds = _timed(lambda: capture(lambda: self.fn(*static), generators=self.generators))
            self._graphs[key] = (graph, static, out)
            self.capture_s += seconds

    @property
    def count(self) -> int:
        """Graphs captured (one per input signature)."""
        return len(self._graphs)

    def __call__(self, *inputs: Tensor) -> T:
        self.capture(*inputs)
        graph, static, out = self._graphs[_signature(inputs)]
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return out


class CapturedDraft(Generic[T]):
    """A round's draft step (a drafter's ``propose``, or its compiled version, and whatever the engine does with the
    tree before the verify) captured as one CUDA graph.

    ``fn()`` must read the call's ``DecodeState`` tensors and the drafter's state in place (both persistent within
    a ``generate`` call), so the graph is valid for one call. The warm-up runs' writes are undone by restoring
    ``mutated`` (``drafter.graph_state()`` plus anything else ``fn`` writes) from a snapshot before each of them and
    before the capture. :meth:`valid_for` says whether the graph still addresses a given list of such tensors
    (a drafter that reallocated its state needs a new graph).
    """

    count = 1

    def __init__(self, fn: Callable[[], T], mutated: Sequence[Tensor]) -> None:
        mutated = list(mutated)
        self._addresses = _addresses(mutated)
        snapshot = [t.clone() for t in mutated]

        def restore() -> None:
            for t, saved in zip(mutated, snapshot):
                t.copy_(saved)

        (self.graph, self.out), self.capture_s = _timed(lambda: capture(fn, reset=restore))

    def valid_for(self, mutated: Sequence[Tensor]) -> bool:
        """Whether ``mutated`` are the tensors (same storage, shape and dtype) the graph was captured on."""
        return _addresses(mutated) == self._addresses

    def __call__(self) -> T:
        self.graph.replay()
        return self.out


def _addresses(tensors: Sequence[Tensor]) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall seconds, between device syncs (so work queued before it is not counted): a capture's
    cost, reported apart from the rounds' (``DecodeStats.time_capture``). Captures are rare; the syncs cost
    nothing per round."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _signature(inputs: Sequence[Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


__all__ = ["CapturedCall", "CapturedDraft", "capture"]
