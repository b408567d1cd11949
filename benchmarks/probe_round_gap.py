"""Where does a round's wall time go beyond its phases? (issue 32: Qwen2.5-32B's rounds lost 1.0-1.3 ms)

The committed ``step_latency.json`` (fe76d73) has Qwen2.5-32B's LongSpec rounds 1.0-1.3 ms longer as ``generate``
runs them (wall) than their draft + verify + accept phases, with the 69- and 53-node trees, where Llama-3-8B's and
the pair's lose <= 94 us. This probe times one decoder's rounds (:func:`benchmarks.step_parts.round_times`) with the
caching allocator's counters around the wall loop (a retry frees cached blocks and synchronises the device), alone
and then with ``--hold`` GB of extra tensors alive (the step benchmark keeps the plain run's and other runs' KV
caches), each twice back to back (the step benchmark times the phases first and the wall
loop after them: a clock that falls as the device heats would show as a later pass's longer phases), and traces a
few wall-loop rounds with ``torch.profiler`` (host and device): per round the device's busy
time, every idle gap on the device over ``--gap-us`` with the host calls running while it idled, and the kernels'
time by name. Writes ``round_gap.txt`` and the trace (``round_gap_trace.json.gz``) under ``--out``.

Usage (GPU): ``python -m benchmarks.probe_round_gap --model Qwen2.5-32B --tree 4-12-12-12-12 --fp8 --reduced 32768``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import time

import torch

from benchmarks.bench_step_latency import _inductor_settings
from benchmarks.harness import tree_shape
from benchmarks.step_parts import round_times, target_and_draft

_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def _counters() -> dict:
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in _COUNTERS}


def _clocks() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    for why in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):  # newer, older drivers' name
        q = f"clocks.sm,clocks.mem,power.draw,temperature.gpu,{why}"
        got = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True)
        if got.returncode == 0:
            return got.stdout.strip()
    return "nvidia-smi: " + got.stderr.strip()[:100]


def timed(dec, context: int, iters: int, say) -> None:
    """Phases, wall and the allocator's counters over one :func:`round_times` call."""
    free, total = torch.cuda.mem_get_info()
    before = _counters()
    say(f"  free {free / 2**30:.1f} of {total / 2**30:.1f} GiB, allocated {torch.cuda.memory_allocated() / 2**30:.1f}"
        f", reserved {torch.cuda.memory_reserved() / 2**30:.1f}; clocks before: {_clocks()}")
    t = round_times(dec, context, iters)
    after = _counters()
    phases = t["phases_us"]
    total_phases = sum(phases.values())
    after_phases = sum(t["phases_after_us"].values())
    say(f"  phases {', '.join(f'{k} {v:.0f}' for k, v in phases.items())} = {total_phases:.0f} us; wall "
        f"{t['round_wall_us']:.0f} us; gap {t['round_wall_us'] - total_phases:.0f} us; phases after the wall loop "
        f"{after_phases:.0f} us; clocks after: {_clocks()}")
    say("  allocator over the call: " + ", ".join(f"{k} +{after[k] - before[k]}" for k in _COUNTERS))
    del t


def traced(dec, context: int, rounds: int, gap_us: float, out_dir: str, say) -> None:
    """``rounds`` rounds as generate runs them under torch.profiler: the device's busy time per round, its idle gaps
    over ``gap_us`` with the host calls running while it idled, and the kernels' time by name."""
    run = dec.synthetic_run(context, rounds=rounds + 8)
    with dec.rounds():
        for _ in range(3):  # first use (capture, compile) and a warm round
            dec.step(run)
            run.read()()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            t0 = time.perf_counter()
            pending = None
            for _ in range(rounds):
                dec.step(run)
                after = run.read()
                if pending is not None:
                    pending()
                pending = after
            pending()
            wall = (time.perf_counter() - t0) * 1e6 / rounds
    path = os.path.join(out_dir, "round_gap_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)
    say(f"  traced {rounds} rounds: {wall:.0f} us a round on the host clock (profiled)")
    summarise(trace, rounds, gap_us, say)


def summarise(trace: dict, rounds: int, gap_us: float, say) -> None:
    """A chrome trace of ``rounds`` rounds: the device's span and busy time a round, its idle gaps over ``gap_us``
    (each with the host calls that ran through most of it and the Python frames open when it began), and the
    kernels' device time by name."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op", "python_function")]
    say(f"  {len(device)} device events, {len(host)} host events")
    if not device:
        return
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    busy = sum(e["dur"] for e in device)
    say(f"  device: {span / rounds:.0f} us a round from first start to last end, {busy / rounds:.0f} busy")
    gaps = []
    end = device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        if e["ts"] - end > gap_us:
            gaps.append((end, e["ts"], e))
        end = max(end, e["ts"] + e["dur"])
    say(f"  {len(gaps)} device gaps over {gap_us:.0f} us, {sum(b - a for a, b, _ in gaps) / rounds:.0f} us a round:")
    for a, b, nxt in gaps[:40]:
        during = sorted((h for h in host if h["ts"] < b and h["ts"] + h["dur"] > a and h["dur"] > 0.5 * (b - a)
                         and h.get("cat") != "python_function"), key=lambda h: -h["dur"])[:3]
        stack = sorted((h for h in host if h.get("cat") == "python_function" and h["ts"] <= a <= h["ts"] + h["dur"]),
                       key=lambda h: h["dur"])[:4]
        say(f"    at {(a - device[0]['ts']) / 1e3:8.2f} ms: {b - a:7.1f} us idle, then {nxt['name'][:60]}")
        for h in during:
            say(f"        host {h['cat']}: {h['name'][:70]} ({h['dur']:.0f} us)")
        if stack:
            say("        python: " + " < ".join(h["name"][:50] for h in stack))
    by_name: dict[str, float] = {}
    for e in device:
        by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
    say("  kernels by device time a round:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]:
        say(f"    {us / rounds:9.1f} us  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen2.5-32B")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tree", default="4-12-12-12-12")
    ap.add_argument("--fp8", action="store_true", help="the draft from float8 weight copies")
    ap.add_argument("--reduced", type=int, default=0, help="a drafting vocabulary of this many tokens (0: full)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hold", type=float, nargs="*", default=[0.0, 26.0],
                    help="GB of extra tensors held alive for each timed pass")
    ap.add_argument("--reps", type=int, default=2, help="timed passes back to back at each --hold (clocks drift?)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds traced")
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--inductor", nargs="*", default=["combo_kernels=True"])
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from longspec import LongSpecDrafter, SpeculativeDecoder
    from longspec.model.draft import frequent_tokens

    os.makedirs(a.out, exist_ok=True)
    lines = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    _inductor_settings(ap, a.inductor)
    target, draft = target_and_draft(a.model)
    if a.reduced:
        vocab = target.get_output_embeddings().weight.shape[0]
        counts = torch.randint(0, 1 << 20, (vocab,), generator=torch.Generator().manual_seed(0))
        draft.set_draft_vocab(frequent_tokens(counts, a.reduced))
    dec = SpeculativeDecoder(target, LongSpecDrafter(draft, weight_dtype=torch.float8_e4m3fn if a.fp8 else None),
                             tree_shape=tree_shape(a.tree), cuda_graphs=True, compile=True)
    say(f"{a.model} N={a.context} tree {a.tree} fp8={a.fp8} reduced={a.reduced}; {torch.cuda.get_device_name()}")
    for gb in a.hold:
        held = torch.empty(int(gb * 2**30), dtype=torch.uint8, device="cuda") if gb else None
        for rep in range(a.reps):
            say(f"holding {gb:.0f} GB more, pass {rep + 1}:")
            timed(dec, a.context, a.iters, say)
        del held
        torch.cuda.empty_cache()
    say("trace (nothing held):")
    traced(dec, a.context, a.rounds, a.gap_us, a.out, say)
    with open(os.path.join(a.out, "round_gap.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
