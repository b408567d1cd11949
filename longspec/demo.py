"""``longspec demo``: the shipped trained pair decodes a held-out long code prompt plainly, with prompt lookup and
with the LongSpec draft; it prints tau, decode tokens/s, end-to-end time and whether each output is identical to
plain decoding, one line per method as each finishes.

The pair (:mod:`longspec.pretrained`) was trained on Python source split by package; the prompt is built from a
held-out package of this machine's standard library, so the model never saw it in training. Every output must equal
plain decoding's token for token (the exit status checks it).

Defaults by device (:func:`defaults`): on a CPU a 4096-token prompt in float32 (FAST numerics are exact there).
The 69-node verify is compute-bound on a CPU (about ten decode steps' cost), so the tree loses to plain decoding
there even at tau 3-4 and the closing line says so. On a GPU a 32768-token prompt in bfloat16, where the method
pays; bf16 verify and decode kernels round differently (outputs may part where the target's top two logits nearly
tie), so the GPU default runs every method, plain decoding included, with ``Numerics.INVARIANT``, whose outputs are
equal token for token in bf16 too. ``numerics="fast"`` shows the fastest kernels instead.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

import torch

TREE = (4, 16, 16, 16, 16)
NUMERICS = ("fast", "invariant")
# The default held-out prompt: seed 21 of heldout_stdlib_prompt, which (on CPython 3.11's standard library) ends in
# CPython's test/test_scope.py after other files of its package; the pair continues it with code that reads like
# code. Seed 0 ends in a test-data file of the same package, where greedy decoding repeats one line (`c = b'A'`).
DEFAULT_SEED = 21


@dataclass
class DemoResult:
    method: str
    tau: float
    tokens_per_s: float  # generated tokens per second of decoding (prefill excluded)
    end_to_end_s: float  # the whole generate call: prefill, drafter prefill and decoding
    identical: bool
    first_difference: int | None  # generated-token index where the output leaves plain decoding's


@dataclass
class DemoReport:
    package: str  # the held-out package the prompt comes from
    context: int
    new_tokens: int
    device: str
    dtype: str
    results: list[DemoResult]
    continuation: str  # plain decoding's generated text


def defaults(device: torch.device, context: Optional[int] = None, dtype: Optional[str] = None,
             numerics: Optional[str] = None) -> tuple[int, str, str]:
    """(context, dtype, numerics) with what was not given filled in for ``device``: 4096 / float32 on a CPU,
    32768 / bfloat16 on a GPU; invariant numerics unless float32 (where fast ones are exact)."""
    cpu = device.type == "cpu"
    dtype = dtype or ("float32" if cpu else "bfloat16")
    return context or (4096 if cpu else 32768), dtype, numerics or ("fast" if dtype == "float32" else "invariant")


def run_demo(context: int = 4096, new_tokens: int = 128, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32, seed: Optional[int] = None,
             on_prompt: Optional[Callable[[str, int], None]] = None,
             on_result: Optional[Callable[[DemoResult], None]] = None, numerics: str = "fast") -> DemoReport:
    """Decode one held-out prompt with every method. ``on_prompt(package, context)`` is called once the prompt is
    built and ``on_result(result)`` as each method finishes (the command prints from them). ``numerics``: "fast" or
    "invariant" (:class:`longspec.Numerics`), the same for every method."""
    from longspec import LongSpecDrafter, Numerics, PromptLookupDrafter, SpeculativeDecoder
    from longspec.pretrained import heldout_stdlib_prompt, load_code_pair
    from longspec.testing import first_difference

    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    mode = Numerics.INVARIANT if numerics == "invariant" else Numerics.FAST
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pair = load_code_pair(device, dtype)
    ids, package = heldout_stdlib_prompt(pair.tokenizer, context, seed=DEFAULT_SEED if seed is None else seed)
    ids = ids.to(device)
    if on_prompt is not None:
        on_prompt(package, ids.shape[1])
    cuda = device.type == "cuda"
    methods = {
        "plain decoding (same kernels)": (None, (1,)),
        "prompt lookup, chain of 6": (PromptLookupDrafter(), (1,) * 6),
        "LongSpec draft, tree 4-16-16-16-16": (LongSpecDrafter(pair.draft), TREE),
        "LongSpec draft, chain of 5": (LongSpecDrafter(pair.draft), (1,) * 5),
    }
    results, reference = [], None
    for name, (drafter, shape) in methods.items():
        dec = SpeculativeDecoder(pair.target, drafter, tree_shape=shape, cuda_graphs=cuda, numerics=mode)
        if cuda:  # kernel compilation and graph capture before the timed call (on a CPU there is neither)
            dec.warmup(batch_sizes=(1,), max_context=ids.shape[1] + new_tokens, progress=False)
        t0 = time.perf_counter()
        out = dec.generate(ids, new_tokens, eos_token_id=[])
        if cuda:
            torch.cuda.synchronize()
        total_s = time.perf_counter() - t0
        decode_s = total_s - out.stats.time_prefill
        generated = out.sequences[:, ids.shape[1]:]
        reference = generated if reference is None else reference
        diff = first_difference(generated, reference)
        result = DemoResult(name, out.stats.tau, out.stats.generated_tokens / decode_s, total_s, diff is None, diff)
        results.append(result)
        if on_result is not None:
            on_result(result)
    text = pair.tokenizer.decode(reference[0])
    return DemoReport(package, context, new_tokens, str(device), str(dtype).removeprefix("torch."), results, text)


_ROW = "{:36s} {:>5s} {:>13s} {:>8s} {:>13s}  {}"


def verdict(report: DemoReport) -> str:
    """One line from the measured rows: the fastest method here and, when the LongSpec tree does not pay, why (its
    round's cost in plain decoding steps, tau / speedup, against the tokens it emits)."""
    plain = report.results[0].tokens_per_s
    best = max(report.results, key=lambda r: r.tokens_per_s)
    line = f"fastest here: {best.method} ({best.tokens_per_s / plain:.2f}x plain decoding)"
    tree = next((r for r in report.results if r.method.startswith("LongSpec draft, tree")), None)
    if tree is None or tree.tokens_per_s >= plain:
        return line
    steps = tree.tau / (tree.tokens_per_s / plain)
    where = ("on a CPU the 69-node verify is compute-bound" if report.device.startswith("cpu") else
             "at this context the draft and verify cost more than they return")
    return (f"{line}; the LongSpec tree emits {tree.tau:.2f} tokens a round but a round costs {steps:.1f} plain "
            f"steps here ({where}; on a GPU at 8k-64k: benchmarks/results/h100/e2e.md)")


def print_demo(context: int, new_tokens: int, device: torch.device, dtype: str, seed: Optional[int] = None,
               out: Optional[TextIO] = None, numerics: str = "fast") -> int:
    """Run the demo and print it (to ``out``, default stdout) as it goes; 0 when every output equals plain
    decoding's, else 1."""
    def say(line: str) -> None:
        print(line, file=out or sys.stdout, flush=True)

    from longspec.pretrained import pair_path

    params = json.loads((pair_path() / "pair.json").read_text())["target"]["params"]
    say(f"longspec demo: the shipped code pair (target {params / 1e6:.1f}M parameters + LongSpec draft), {device} "
        f"{dtype}, {numerics} numerics; loading it and building the prompt")
    if torch.device(device).type == "cuda":
        say("each decoder is warmed up first (Triton compiles, CUDA graphs captured: a few seconds each), untimed")
    base: dict[str, float] = {}  # plain decoding's tokens/s, the first row

    def on_prompt(package: str, n: int) -> None:
        say(f"prompt: {n} tokens of held-out package {package!r} from this machine's standard library; "
            f"{new_tokens} new tokens, greedy")
        say(_ROW.format("method", "tau", "decode tok/s", "speedup", "end-to-end s", "identical to plain"))

    def on_result(r: DemoResult) -> None:
        plain = base.setdefault("tokens_per_s", r.tokens_per_s)
        same = "yes" if r.identical else f"NO (from token {r.first_difference})"
        say(_ROW.format(r.method, f"{r.tau:.2f}", f"{r.tokens_per_s:.1f}", f"{r.tokens_per_s / plain:.2f}x",
                        f"{r.end_to_end_s:.1f}", same))

    report = run_demo(context, new_tokens, device, getattr(torch, dtype), seed, on_prompt, on_result, numerics)
    say("end-to-end s: the whole generate call; decode tok/s: tokens per second after the target's prefill (a "
        "LongSpec draft's own prefill counts as decoding)")
    say(verdict(report))
    say("continuation (plain decoding):\n" + report.continuation)
    return 0 if all(r.identical for r in report.results) else 1
