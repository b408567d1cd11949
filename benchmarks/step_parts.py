"""The parts of a round the step benchmarks time (:mod:`benchmarks.bench_step_latency`,
:mod:`benchmarks.bench_step_adaptive`): the models, a round's phases and wall time as ``generate`` runs it, the draft
step's kernel profile, and the floors (every linear, the layers' attention kernels, the draft's bytes)."""
from __future__ import annotations

import statistics
import time

import torch

TREE = (4, 16, 16, 16, 16)


def target_and_draft(name: str, device: str = "cuda", tp: bool = False, mlp_ratio: float = 1.0,
                     cross_blocks: int = 0):
    """(target, draft) in bf16: a published config with a fresh draft, or the shipped trained pair. ``tp``: the
    target sharded over the ``torchrun`` launch (the draft whole on every rank, the same on every rank).
    ``mlp_ratio``: a published shape's draft MLP has this many times the target's units (a widened draft,
    :func:`longspec.model.draft_grow.widen_mlp`); ``cross_blocks``: it has that many extra cross-attention + MLP
    blocks (``extra_cross_blocks``); the shipped pair's draft is as it was trained."""
    from longspec import LongSpecDraft
    from longspec.testing import published_target

    if name == "pair":
        from longspec.pretrained import load_code_pair

        if tp:
            raise SystemExit("--tp: the shipped pair's target fits one GPU; use a published shape")
        pair = load_code_pair(device, torch.bfloat16)
        return pair.target, pair.draft
    target = published_target(name, device, tensor_parallel=tp)
    torch.manual_seed(0)  # the same draft on every rank
    units = round(mlp_ratio * target.config.get_text_config().intermediate_size)
    with torch.device(device):
        draft = LongSpecDraft.from_target(target, intermediate_size=units, extra_cross_blocks=cross_blocks)
    return target, draft


def _events_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` blocks of the mean device time of ``iters`` back-to-back calls, in microseconds."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _graph_us(fn, iters: int) -> float:
    from longspec.decode.graphs import capture

    graph, _ = capture(fn)
    return _events_us(graph.replay, iters)


def round_times(dec, context: int, iters: int, option=None) -> dict:
    """Per-phase device time (PhaseTimer events) and the wall time of whole rounds as ``generate`` runs them (its
    host one round ahead of the device, one read per round waited for, and under a budget a choice), in us;
    ``option``: the adaptive budget's option to force every round (its host work timed with it).

    The first round captures the graphs (and compiles, with ``compile=True``): its wall time is reported as the
    first-use cost. The phases are timed again after the wall loop (``phases_after_us``): a wall round longer than
    the phases before it, with the phases after it longer too, is the device slowing down (clocks), not idle time.
    Returns the run too (its cache serves the attention floor)."""
    from longspec.decode.stats import PhaseTimer

    run = dec.synthetic_run(context, rounds=4 * iters + 4)

    def wait(read):  # generate's wait for a round's read (and, under a budget, its choice)
        read()
        if dec.budget is not None:
            dec._choose(run)

    with dec.rounds():
        t0 = time.perf_counter()
        dec.step(run, option=option)
        wait(run.read())
        first = time.perf_counter() - t0
        dec.step(run, option=option)
        timer = PhaseTimer(run.state.root.device, enabled=True)
        for _ in range(iters):
            dec.step(run, timer, option=option)
        phases = {k: v * 1e6 / iters for k, v in timer.seconds().items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = None
        for _ in range(iters):  # as generate runs rounds: round k + 1 is enqueued before the host waits for round k
            dec.step(run, option=option)
            after = run.read()
            if pending is not None:
                wait(pending)
            pending = after
        wait(pending)
        wall = (time.perf_counter() - t0) * 1e6 / iters
        timer = PhaseTimer(run.state.root.device, enabled=True)
        for _ in range(iters):
            dec.step(run, timer, option=option)
        later = {k: v * 1e6 / iters for k, v in timer.seconds().items()}
    return {"phases_us": phases, "round_wall_us": wall, "phases_after_us": later, "first_round_s": first, "run": run}


def profile_draft(dec, context: int, replays: int = 10, rows: int = 40) -> str:
    """torch.profiler's kernel table over ``replays`` replays of ``dec``'s captured draft graph (its ``propose``)
    at ``context`` committed rows: where a draft step's device time goes, kernel by kernel."""
    run = dec.synthetic_run(context, rounds=8)
    with dec.rounds():
        dec.step(run)  # compiles and captures the draft graph
        graph = run.slot.drafts[(None, None)].graph
        graph.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90)
    return table + "\n" + _timeline(prof, replays)


def _timeline(prof, replays: int) -> str:
    """The middle replay kernel by kernel, in launch order: start, duration and the idle gap before each kernel
    (us), so a step's time splits into kernel time and the gaps between dependent launches."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // max(1, replays)
    one = kernels[(replays // 2) * per:(replays // 2 + 1) * per]
    if not one:
        return ""
    t0 = one[0].time_range.start
    lines = [f"One replay: {len(one)} kernels, {one[-1].time_range.end - t0:.1f} us from the first start to the "
             f"last end, {sum(e.time_range.end - e.time_range.start for e in one):.1f} us in kernels", "",
             "| start | us | gap | kernel |", "|---|---|---|---|"]
    prev = t0
    for e in one:
        start, end = e.time_range.start, e.time_range.end
        lines.append(f"| {start - t0:.1f} | {end - start:.1f} | {start - prev:.1f} | {e.name[:110]} |")
        prev = end
    return "\n".join(lines) + "\n"


def draft_floor_us(draft, target, context: int, depth: int, vocab_rows: int, copy_bytes_per_s: float,
                   fp8: bool = False) -> float:
    """The bytes a draft step must read over the copy bandwidth: per level (``depth`` levels run) the block's live
    weights (not the dead cross-attention k/v projections), ``vocab_rows`` rows of the LM head and the target's
    last-layer K/V of the committed rows once per cross-attention (the block's and each extra block's). ``fp8``: the linears' weights and the head rows
    at one byte an element plus a float32 scale a row (``LongSpecDrafter(weight_dtype=torch.float8_e4m3fn)``)."""
    dead = {"cross_attn.k_proj.weight", "cross_attn.k_proj.bias", "cross_attn.v_proj.weight", "cross_attn.v_proj.bias"}
    live = [(n, p) for n, p in draft.named_parameters() if n not in dead]
    if fp8:
        block = sum(p.numel() + 4 * p.shape[0] if n.endswith("proj.weight") else local_bytes(p) for n, p in live)
    else:
        block = sum(local_bytes(p) for _, p in live)
    head = target.get_output_embeddings().weight
    head_bytes = vocab_rows * head.shape[1] * (1 if fp8 else head.element_size()) + (4 * vocab_rows if fp8 else 0)
    c = draft.config
    kv = 2 * context * c.num_key_value_heads * c.head_dim * head.element_size()
    return depth * (block + head_bytes + (1 + c.extra_cross_blocks) * kv) / copy_bytes_per_s * 1e6


def linear_floor_us(target, rows: int, iters: int) -> float:
    """All of the target's nn.Linear layers (LM head included) at M = ``rows``, one graph, cold weights."""
    lins = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(1, rows, m.in_features, device="cuda", dtype=torch.bfloat16) for m in lins}

    def run():
        for m in lins:
            torch.nn.functional.linear(xs[m.in_features], m.weight, m.bias)

    with torch.inference_mode():
        return _graph_us(run, iters)


def attention_floor_us(run, context: int, rows: int, iters: int) -> float:
    """The attention op of every layer over its own cache (``prefix_attn`` at M = 1, else ``hybrid_tree_attn`` at
    M = ``rows`` under a chain mask), in one graph."""
    cache, cfg = run.state.cache, run.state.target.config
    Hq, D = cfg.num_attention_heads, cache.kv.shape[-1]
    q = torch.randn(1, rows, Hq, D, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(1, rows, cache.kv.shape[-2], D, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(rows, rows, dtype=torch.bool, device="cuda").tril()[None]
    lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
    lens_q = torch.full((1, 1), context + 1, dtype=torch.int32, device="cuda")
    scale = D ** -0.5

    def run():
        for layer in range(cache.num_layers):
            k, v = cache.key(layer), cache.value(layer)
            if rows == 1:
                torch.ops.longspec.prefix_attn(q, k, v, lens_q, scale)
            else:
                torch.ops.longspec.hybrid_tree_attn(q, k, v, lens, kt, kt, mask, scale)

    with torch.inference_mode():
        return _graph_us(run, iters)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
