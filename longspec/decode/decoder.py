"""SpeculativeDecoder: lossless speculative (or plain) decoding of a Hugging Face causal LM on longspec's kernels.

A generate call:

1. **Prompt.** A left-padded batch (``attention_mask``) is made left-aligned: token j of a row sits at position j
   and cache row j. A preallocated :class:`~longspec.model.target.StaticKVCache` holds every layer.
2. **Prefill** (chunked) writes the prompt's K/V and samples the first token, the *root*: pending, at position
   ``seqlens[b]``, not yet in the cache.
3. **Rounds.** With a drafter: propose a tree rooted at the root, verify it in one target forward
   (``hybrid_tree_attn``), accept by the point-mass rule (:mod:`~longspec.decode.verify`), compact the accepted
   path's K/V with ``commit_kv_`` (all layers, one call; or see :class:`KVUpdate`) and advance ``seqlens``; the last
   emitted token is the next root. Without a drafter ("Vanilla FA"): one token per forward through ``prefix_attn``.
4. **Stops per row:** EOS ids, exactly ``max_new_tokens``; tokens after a stop in the same round are dropped and a
   stopped row stays in the batch, masked. The only host sync per round reads whether any row is still active.

With ``cuda_graphs=True`` a round is graph replays only (:mod:`~longspec.decode.graphs`): the drafter's
``propose``, the target forward, and the *tail* (draws, acceptance, stops, ``commit_kv_`` and the state update).
With ``compile=True`` the target's layers (:class:`~longspec.model.target.CompiledTarget`), the drafter's
``propose`` and the tail are ``torch.compile``d, so each replays as a few fused kernels per layer instead of
dozens of small ones.

Sampling is :func:`~longspec.decode.sampling.sample_tokens` for both paths; with a ``seed`` the speculative output
equals plain decoding's token for token.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)
from longspec.model.invariant import InvariantTarget
from longspec.model.parallel import tensor_parallel
from longspec.model.target import (
    CompiledTarget,
    StaticKVCache,
    check_generation_length,
    check_supported,
    forward_extend,
    forward_tree,
    lm_logits,
    use_longspec_attention,
)

from .budget import AcceptanceStats, AdaptiveBudget, CostModel, fit_line, root_tree, sampling_key, tail_label
from .drafter import DecodeState, DraftTree, Drafter, TreeSpec
from .graphs import CapturedCall, CapturedDraft
from .prompt import Prompt, eos_ids, output_sequences, pad_id, prepare_prompt
from .sampling import NoiseKey, SamplingParams, noise_key, sample_tokens
from .stats import DecodeStats, PhaseTimer, accept_lengths, collect_stats
from .tail import TAIL
from .tree import complete_tree, prefix_tree_mask, tree_positions

Streamer = Callable[[Tensor, Tensor], None]


class KVUpdate(enum.Enum):
    """How the accepted path's K/V reach their committed rows after a verify (both exact; measure, keep the faster).

    COMMIT: ``commit_kv_`` moves the path's rows into place in every layer (one launch for all layers).
    REFEED: only the last layer is compacted (the rows a LongSpec draft reads); the next verify forward re-feeds the
            path ahead of the tree (depth + 1 more query slots), which rewrites those rows in every layer. Between
            rounds the other layers hold valid rows only up to ``seqlens - pending``, so drafters that read them
            (:class:`~longspec.decode.streaming.StreamingSelfDrafter`) need COMMIT.
    """

    COMMIT = enum.auto()
    REFEED = enum.auto()


class Numerics(enum.Enum):
    """How the target's decode and verify forwards round.

    FAST: the fastest kernels (cuBLAS linears, PyTorch norms, split-KV attention sized by the launch). In float32
          speculative output equals plain decoding's; in bf16 a near-tie of the next-token logits may flip, because
          a verify forward (T tokens) and a decode forward (1 token) reduce in different orders.
    INVARIANT: batch-invariant kernels (:mod:`longspec.model.invariant`): one fixed GEMM tiling for every M
          (split-K chosen by N and K only, the partials summed in a fixed order), row-wise RMSNorm, and attention
          split at fixed absolute key positions where each tree node sees exactly the keys decoding would after its
          ancestors are committed. A token's logits inside a verify forward are then bitwise equal to plain
          decoding's (``drafter=None`` in this mode: the reference) for any tree, drafter and batch row, in bf16
          too, so the output equals plain decoding in this mode token for token. The prefill (identical for both)
          stays FAST. ``compile=True`` compiles the target's layers around the invariant ops as in FAST mode;
          Inductor's fused elementwise code (RoPE, SiLU * up, residual adds) rounds differently from eager's, so
          the reference is then plain decoding in this mode *and* compile setting. Cost (H200, bf16, Llama-3-8B,
          32k, ``compile=True``): decode 1.14x, verify 1.42x and a LongSpec round 1.31x the FAST mode's, mostly
          the attention (46 / 131 us per layer at M = 1 / 69 against 38 / 87) and the linears at the verify width
          (``python -m benchmarks.bench_step_latency --numerics both``, ``python -m benchmarks.sweep_invariant``).
          Needs ``KVUpdate.COMMIT`` and a target on one device (no tensor parallelism).
    """

    FAST = enum.auto()
    INVARIANT = enum.auto()


@dataclass
class GenerateOutput:
    """What :meth:`SpeculativeDecoder.generate` returns.

    sequences:      int64 ``[B, S_in + G]``: the input as given, then each row's generated tokens (G = the longest
                    row's count), right-padded with the pad id (the EOS id when the model has none) after it stopped.
    accept_lengths: list of B lists: ``accept_lengths[b][r]`` = tokens row b emitted by the r-th verify forward it
                    took part in (accepted drafts + bonus, after stop truncation; always 1 for plain decoding). The
                    first token, sampled by the prefill, is not counted, so ``1 + sum(accept_lengths[b])`` is row
                    b's generated length.
    stats:          :class:`DecodeStats`.
    """

    sequences: Tensor
    accept_lengths: list[list[int]]
    stats: DecodeStats


@dataclass
class Run:
    """The mutable state of one generate call (static shapes; updated in place); :meth:`SpeculativeDecoder.step`
    advances it by one round."""

    state: DecodeState
    params: SamplingParams
    eos: Tensor  # int64 [E]
    max_new: int
    generated: Tensor  # int64 [B] tokens emitted so far, root included
    generator: Optional[torch.Generator]
    pending: Tensor  # int64 [B] (REFEED) rows [seqlens - pending, seqlens) held by the last layer only
    history: list[Tensor] = field(default_factory=list)  # per round: int64 [B] tokens emitted
    nodes: list[int] = field(default_factory=list)  # per round: the verified tree's node count
    predicted: list[Tensor] = field(default_factory=list)  # per round under a budget: its option's realised tau []
    options: list[str] = field(default_factory=list)  # per round under a budget: the chosen option's label
    draft_graphs: dict = field(default_factory=dict)  # option index (None: the fixed tree) -> CapturedDraft
    tails: dict = field(default_factory=dict)  # (tail name, nodes) -> this call's round tail as a CUDA graph
    dropped_capture_s: float = 0.0  # capture seconds of draft graphs dropped within the call (drafter re-prefilled)
    seed: Optional[NoiseKey] = None  # params.seed as data (noise_key), when seeded
    # adaptive budget (SpeculativeDecoder(budget=...)): statistics, and what the last sync read for the choice
    stats: Optional[AcceptanceStats] = None
    report: Optional[Tensor] = None  # float32 [2B + 2K]: what the sync reads (_write_report), written by the tail
    context: float = 0.0  # mean committed length of the active rows
    realised: list = field(default_factory=list)  # each option's running realised tau
    seen: list = field(default_factory=list)  # whether it has one
    stale: bool = False  # the drafter sat out a round and has no observe(): prefill it before it drafts again

    @property
    def noise_generator(self) -> Optional[torch.Generator]:
        """The generator the draws consume: only unseeded sampling draws from one (greedy and seeded need none)."""
        return None if self.params.greedy or self.params.seed is not None else self.generator


class SpeculativeDecoder:
    """Lossless speculative decoding for a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3).

    Args:
        target: the model to decode (any dtype/device; it is run in eval semantics under ``inference_mode``).
        drafter: a :class:`~longspec.decode.drafter.Drafter` or None for plain decoding on the same kernels.
        tree_shape: nodes per depth (``(4, 16, 16, 16, 16)``: 69 nodes with the root; a chain is ``(1, 1, 1, 1)``),
            or a :class:`~longspec.decode.drafter.TreeSpec` (``TreeSpec.merged(...)`` for a
            :class:`~longspec.decode.merge.MergedDrafter`).
        cuda_graphs: replay every round from CUDA graphs (CUDA only): the target's decode / verify forwards
            (captured once per decoder), the drafter's ``propose`` when it offers ``graph_state()`` (all three
            built-in drafters do) and the round's tail (captured once per ``generate`` call).
        compile: ``torch.compile`` the target's decoder layers (:class:`~longspec.model.target.CompiledTarget`),
            the drafter's ``propose`` when it declares ``compilable = True`` (the LongSpec and prompt-lookup
            drafters do) and the round's tail. The first round of each new shape waits for the compile (seconds
            per compiled function; torch.compile caches the results on disk, so later processes wait less).
        prefill_chunk_size: prompt tokens per prefill forward (bounds prefill activation memory).
        max_cache_len: refuse requests needing more cache rows than this (prompt + max_new_tokens + scratch rows).
        kv_update: :class:`KVUpdate` strategy for the accepted path's K/V (COMMIT by default).
        phase_times: split each call's decoding time into draft / verify / accept in its
            :class:`~longspec.decode.stats.DecodeStats` (CUDA events around the phases; off: no cost at all).
        budget: an :class:`~longspec.decode.budget.AdaptiveBudget`: each round verifies the tree (a plain step, or
            the drafter's tree cut to a depth limit and pruned to its most promising nodes, per row) with the
            highest expected tokens per second; None verifies the whole ``tree_shape`` tree every round. Its cost
            model is calibrated at the first ``generate`` of each batch size unless given (see
            :meth:`calibrate`).
        numerics: :class:`Numerics`; ``Numerics.INVARIANT`` makes the target's decode and verify forwards
            batch-invariant, so that speculative output equals plain decoding in that mode bit for bit in any dtype.

    A target sharded by transformers' tensor-parallel plan (:func:`longspec.model.parallel.load_tensor_parallel`
    under ``torchrun``) is decoded the same way on every rank: each rank's cache holds its KV heads only, every
    rank calls ``generate`` with the same arguments and gets the same output.

    The decoder keeps its KV cache between ``generate`` calls (reused when big enough, so captured CUDA graphs stay
    valid); one decoder serves one call at a time.

    Example::

        >>> dec = SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(1, 1, 1, 1))
        >>> out = dec.generate(input_ids, max_new_tokens=64)           # greedy == model.generate(do_sample=False)
        >>> out.sequences.shape                                         # [B, S + generated]
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: Optional[Drafter] = None,
        tree_shape: Sequence[int] = (4, 16, 16, 16, 16),
        cuda_graphs: bool = False,
        prefill_chunk_size: int = 8192,
        max_cache_len: Optional[int] = None,
        kv_update: KVUpdate = KVUpdate.COMMIT,
        compile: bool = False,
        phase_times: bool = False,
        budget: Optional[AdaptiveBudget] = None,
        numerics: Numerics = Numerics.FAST,
    ) -> None:
        check_supported(target)
        # a target sharded by transformers' tensor-parallel plan: every rank runs this same loop on its local heads
        self.tp = tensor_parallel(target)
        _check_drafter(target, drafter, kv_update)
        _check_numerics(numerics, kv_update, self.tp)
        self.numerics = numerics
        self._invariant = InvariantTarget(target) if numerics is Numerics.INVARIANT else None
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be an int >= 1, got {prefill_chunk_size!r}")
        self.target = target
        self.kv_update = kv_update
        self.drafter = drafter
        self.tree = tree_shape if isinstance(tree_shape, TreeSpec) else TreeSpec(tuple(tree_shape))
        if budget is not None and not isinstance(budget, AdaptiveBudget):
            raise TypeError(f"budget must be an AdaptiveBudget or None, got {type(budget).__name__}")
        if budget is not None and drafter is None:
            raise ValueError("budget needs a drafter (plain decoding has no tree to budget)")
        if budget is not None:
            budget.bind(self.tree)
        self.budget = budget
        self.cuda_graphs = bool(cuda_graphs)
        self.prefill_chunk_size = prefill_chunk_size
        self.max_cache_len = max_cache_len
        self._cache: Optional[StaticKVCache] = None
        self._graphs: dict[str, CapturedCall] = {}
        self.phase_times = bool(phase_times)
        self._compiled = CompiledTarget(target) if compile else None
        self._propose_fn = drafter.propose if drafter is not None else None
        self._tail_fns = TAIL
        if compile:
            if getattr(drafter, "compilable", False):
                self._propose_fn = torch.compile(drafter.propose, fullgraph=True)
            self._tail_fns = {name: torch.compile(fn, fullgraph=True) for name, fn in TAIL.items()}

    # -- public ---------------------------------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        eos_token_id: Optional[int | Sequence[int]] = None,
        attention_mask: Optional[Tensor] = None,
        *,
        generator: Optional[torch.Generator] = None,
        streamer: Optional[Streamer] = None,
    ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` tokens per row of ``input_ids`` (int64 ``[B, S]``).

        ``attention_mask`` (``[B, S]``, 1 = token) marks left padding. ``temperature < 1e-5`` is greedy; otherwise
        temperature/top-k/top-p shape the target distribution and sampling is seed-exact when ``seed`` is set
        (else drawn from ``generator``). ``eos_token_id`` defaults to the model's generation config.
        ``streamer(tokens [B, A], counts [B])`` is called after the prefill and after every round with the tokens
        each row emitted (it may sync the device; without it a round reads from the device once, one round behind,
        so the last call may carry no tokens: the round the host ran ahead on finished rows).
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        params = SamplingParams(temperature, top_k, top_p, seed)  # validates each, naming it
        if self.tp is not None and not params.greedy and seed is None and generator is None:
            raise ValueError("sampling from a tensor-parallel target needs seed= (or a generator seeded alike on "
                             "every rank): every rank must draw the same tokens")
        device = self.target.get_output_embeddings().weight.device
        prompt = prepare_prompt(input_ids, attention_mask, device)
        total = prompt.max_len + max_new_tokens
        check_generation_length(self.target, total)
        eos = eos_ids(eos_token_id, self.target)
        timer = PhaseTimer(device, enabled=self.phase_times)
        if self.budget is not None:
            self._ensure_costs(prompt.tokens.shape[0], total, params)
        t0 = time.perf_counter()
        with torch.inference_mode(), use_longspec_attention(self.target):
            run = self._start(prompt, params, eos, max_new_tokens, generator)
            held_capture_s = self._capture_seconds(run)  # the forward graphs held before the rounds
            if streamer is not None:
                streamer(run.state.root[:, None], torch.ones_like(run.generated))
            with self._compiled_layers():
                t1 = self._rounds(run, timer, streamer)
            sequences = output_sequences(input_ids.to(device), prompt, run.state.tokens, run.generated,
                                         pad_id(self.target, eos))
        t2 = time.perf_counter()
        stats = collect_stats(run.history, run.generated, timer, t1 - t0, t2 - t1, run.nodes, run.predicted,
                              self._capture_seconds(run) - held_capture_s, run.options)
        return GenerateOutput(sequences, accept_lengths(run.history, run.generated.shape[0]), stats)

    def _capture_seconds(self, run: Run) -> float:
        """Seconds spent capturing the decoder's forward graphs (over its life) and the call's draft and tail
        graphs."""
        held = list(self._graphs.values()) + list(run.draft_graphs.values()) + list(run.tails.values())
        return run.dropped_capture_s + sum(g.capture_s for g in held)

    # -- phases ---------------------------------------------------------------------------------------------------

    def _start(self, prompt: Prompt, params: SamplingParams, eos: Tensor, max_new: int,
               generator: Optional[torch.Generator]) -> Run:
        """Allocate, prefill, sample the first token and let the drafter prefill."""
        B = prompt.tokens.shape[0]
        cache = self._cache_for(B, prompt.max_len + max_new + self._scratch_rows())
        width = prompt.max_len + max_new + self.tree.depth + 2  # room for a round's writes past the end
        tokens = torch.zeros(B, width, dtype=torch.int64, device=cache.kv.device)
        tokens[:, : prompt.tokens.shape[1]] = prompt.tokens
        logits = self._prefill_logits(cache, prompt)
        root = sample_tokens(logits, params, prompt.lens[:, None], generator)[:, 0]
        return self._begin(cache, tokens, prompt.lens, root, params, eos, max_new, generator)

    def _begin(self, cache: StaticKVCache, tokens: Tensor, lens: Tensor, root: Tensor, params: SamplingParams,
               eos: Tensor, max_new: int, generator: Optional[torch.Generator]) -> Run:
        """The run after the prefill: ``lens`` committed rows per row, ``root`` pending; the drafter prefills."""
        self.tree.depth_tensor(cache.kv.device)  # made here, outside any graph capture
        cache.seqlens.copy_(lens.to(torch.int32))
        tokens.scatter_(1, lens[:, None], root[:, None])
        active = ~torch.isin(root, eos) & (max_new > 1)
        state = DecodeState(self.target, cache, tokens, root, active, max_depth=self.tree.depth)
        zeros = torch.zeros(root.shape[0], dtype=torch.int64, device=root.device)
        run = Run(state, params, eos, max_new, zeros + 1, generator, pending=zeros.clone())
        if params.seed is not None:
            run.seed = noise_key(params.seed, self.target.get_output_embeddings().weight.shape[0], root.device)
        if self.budget is not None:
            run.stats = self.budget.stats_for(sampling_key(params), root.device)
            run.report = torch.zeros(2 * root.shape[0] + 2 * len(run.stats.realised), device=root.device)
            _write_report(run)
        # the token buffer's width changes with every request: one dynamic dimension, not one compile per width
        torch._dynamo.maybe_mark_dynamic(tokens, 1)
        if self.drafter is not None:
            self.drafter.prefill(state, self.tree)
        return run

    def synthetic_run(self, context: int, batch: int = 1, rounds: int = 64, seed: int = 0,
                      params: Optional[SamplingParams] = None) -> Run:
        """A run over ``context`` committed rows of random K/V and random tokens, with no prefill, room for
        ``rounds`` more rounds and no stop: what the step benchmarks time (a round's cost depends on the committed
        length, the shapes and the sampling settings, not on the values). Greedy unless ``params``; unseeded
        sampling runs seeded here (its draws come from a counter instead of a ``torch.Generator``: the same filters
        and about the same work). Drive it with :meth:`step`."""
        device = self.target.get_output_embeddings().weight.device
        max_new = rounds * (self.tree.depth + 1) + 1
        cache = self._cache_for(batch, context + max_new + self._scratch_rows())
        gen = torch.Generator(device=device).manual_seed(seed)
        cache.kv.normal_(generator=gen)
        vocab = self.target.get_output_embeddings().weight.shape[0]
        tokens = torch.randint(0, vocab, (batch, context + max_new + self.tree.depth + 2), device=device,
                               generator=gen)
        lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        no_stop = torch.zeros(0, dtype=torch.int64, device=device)
        with torch.inference_mode(), use_longspec_attention(self.target):
            params = SamplingParams() if params is None else params
            if not params.greedy and params.seed is None:
                params = dataclasses.replace(params, seed=seed)
            return self._begin(cache, tokens, lens, tokens[:, context].clone(), params, no_stop, max_new, None)

    @contextlib.contextmanager
    def rounds(self) -> Iterator[None]:
        """What :meth:`generate` holds around its rounds (inference mode, the longspec attention, the compiled
        layers): :meth:`step` runs inside it."""
        with torch.inference_mode(), use_longspec_attention(self.target), self._compiled_layers():
            yield

    def step(self, run: Run, timer: Optional[PhaseTimer] = None, option: Optional[int] = None) -> None:
        """One round of ``run`` on the device, with no host sync: what :meth:`generate` repeats. Call it inside
        :meth:`rounds`; ``timer`` (a :class:`~longspec.decode.stats.PhaseTimer`) collects its phases' times;
        ``option`` (an index into ``budget.options``) forces the adaptive budget's choice."""
        self._round(run, timer or PhaseTimer(run.state.root.device, enabled=False), None, option)

    def calibrate(self, batch: int, contexts: Sequence[int], reps: int = 3,
                  params: Optional[SamplingParams] = None) -> CostModel:
        """Measure the adaptive budget's costs on this device: every option's round at each committed length in
        ``contexts`` (a synthetic run, as :meth:`synthetic_run`, greedy or with the sampling ``params``), split by
        phase into draft (per draft variant) and verify + tail (per node count: the model's ``verify`` table, or
        its ``sampled`` one under :func:`~longspec.decode.budget.tail_label` of sampled ``params``); each fitted as
        ``a + b * context``. Runs outside ``generate``."""
        budget = self.budget
        if budget is None:
            raise ValueError("calibrate needs a decoder built with budget=AdaptiveBudget(...)")
        options = budget.options
        run = self.synthetic_run(max(contexts), batch, rounds=len(options) * (reps + 1) * len(contexts) + 2,
                                 params=params)
        run.stats = AcceptanceStats(max(1, len(self.tree.parts)), self.tree.depth, len(options), run.state.root.device)
        verify: dict[int, list] = {}
        draft: dict[str, list] = {}
        with self.rounds():
            for context in contexts:
                for i, option in enumerate(options):
                    run.state.cache.seqlens.fill_(context)
                    self.step(run, option=i)  # captures, compiles
                    timer = PhaseTimer(run.state.root.device)
                    for _ in range(reps):
                        self.step(run, timer, option=i)
                    us = {k: v * 1e6 / reps for k, v in timer.seconds().items()}
                    verify.setdefault(option.nodes, []).append((context, us["verify"] + us["accept"]))
                    draft.setdefault(option.draft_key, []).append((context, us["draft"]))
        tail = tail_label(run.params)
        table = {batch: {n: fit_line(p) for n, p in verify.items()}}
        return CostModel({} if tail else table, {batch: {k: fit_line(p) for k, p in draft.items()}},
                         {"device": str(run.state.root.device), "contexts": list(contexts), "reps": reps},
                         {tail: table} if tail else {})

    def _ensure_costs(self, batch: int, extent: int, params: SamplingParams) -> None:
        """Make sure the budget has costs for this batch and sampling: given, cached on disk, or calibrated now
        (and cached)."""
        budget, tail = self.budget, tail_label(params)
        if budget.costs is not None and budget.costs.covers(batch, budget.options, tail):
            return
        path = budget.cost_file(self)
        costs = budget.costs or CostModel()
        if path.is_file():
            costs.update(CostModel.load(path))
        if not costs.covers(batch, budget.options, tail):
            costs.update(self.calibrate(batch, sorted({max(1, extent // 4), extent}), params=params))
            costs.save(path)
        budget.costs = costs

    def _compiled_layers(self) -> contextlib.AbstractContextManager:
        return self._compiled.active() if self._compiled is not None else contextlib.nullcontext()

    def _prefill_logits(self, cache: StaticKVCache, prompt: Prompt) -> Tensor:
        """Write the prompt's K/V chunk by chunk; float32 logits ``[B, 1, V]`` at each row's last prompt token."""
        B, S = prompt.tokens.shape
        last = (prompt.lens - 1)[:, None, None]
        hidden_last = None
        for lo in range(0, S, self.prefill_chunk_size):
            hi = min(lo + self.prefill_chunk_size, S)
            cache.seqlens.fill_(lo)  # rows past a short prompt's end get filler K/V, never visible later
            hidden = forward_extend(self.target, cache, prompt.tokens[:, lo:hi])
            idx = (last - lo).clamp(0, hi - lo - 1).expand(B, 1, hidden.shape[-1])
            picked = hidden.gather(1, idx)
            in_chunk = ((last[:, 0, 0] >= lo) & (last[:, 0, 0] < hi))[:, None, None]
            hidden_last = picked if hidden_last is None else torch.where(in_chunk, picked, hidden_last)
        return lm_logits(self.target, hidden_last)

    def _rounds(self, run: Run, timer: PhaseTimer, streamer: Optional[Streamer]) -> float:
        """Run rounds until no row is active; returns when the prefill ended (``perf_counter``), i.e. its first read.

        Each round's one host read (whether any row is still active) is copied back asynchronously, and the host
        runs one round ahead: it enqueues round k + 1 before it waits for the read after round k, so the host's work
        between rounds (the read, the budget's choice, the launches) overlaps the device's instead of leaving it
        idle. When that read finds no active row, round k + 1 ran on finished rows only, where it emits, commits and
        moves nothing; its entries are dropped (its device time is the price of the overlap, once per call). The
        budget's choice for round k + 1 uses the statistics read after round k - 1.
        """
        read = self._read(run)
        alive = read()  # the first read ends the prefill
        t1 = time.perf_counter()
        if alive:
            self._round(run, timer, streamer)
            read = self._read(run)
        while alive:
            marks = (len(run.history), len(run.nodes), len(run.predicted), len(run.options))
            self._round(run, timer, streamer)  # round k + 1, enqueued before the read after round k is in
            after = self._read(run)
            alive = read()
            if not alive:
                del run.history[marks[0]:], run.nodes[marks[1]:], run.predicted[marks[2]:], run.options[marks[3]:]
            read = after
        return t1

    def _read(self, run: Run) -> Callable[[], bool]:
        """Enqueue the round's one device-to-host read; the returned function waits for it and says whether any
        row is still active. Under a budget the same read (of the report the round's tail wrote) brings the
        committed length and every option's running realised tau for the next choice (into ``run``)."""
        state, stats = run.state, run.stats
        # under a budget: the report the round's tail wrote (_write_report), so no op runs eagerly here
        values = state.active.any()[None] if stats is None else run.report
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = values.clone()  # the report is rewritten by the next round's tail

        def wait() -> bool:
            if event is not None:
                event.synchronize()
            got = host.tolist()
            if stats is None:
                return bool(got[0])
            B, K = state.root.shape[0], len(stats.realised)
            active, lens = got[:B], got[B: 2 * B]
            n = sum(active)
            run.context = sum(a * c for a, c in zip(active, lens)) / max(n, 1.0)
            run.realised, run.seen = got[2 * B: 2 * B + K], [v > 0 for v in got[2 * B + K:]]
            return n > 0

        return wait

    def _round(self, run: Run, timer: PhaseTimer, streamer: Optional[Streamer], option: Optional[int] = None) -> None:
        """One round on the device: [draft,] target forward, tail. No host sync (the caller reads ``active``).

        A plain round (no drafter, or a budget's plain option under ``KVUpdate.COMMIT``) is the decode forward and
        the plain tail: no tree, no scoring; a drafter sitting it out catches up (``observe``) or is marked stale."""
        index = None if self.drafter is None else self._choose(run) if option is None else option
        if self.drafter is None or (index is not None and self.budget.options[index].spec is None
                                    and self.kv_update is KVUpdate.COMMIT):
            if self.drafter is not None:
                if hasattr(self.drafter, "observe"):
                    with timer.phase("draft"):
                        self.drafter.observe(run.state, self.tree)
                else:
                    run.stale = True  # it will miss this round's tokens
            with timer.phase("verify"):
                logits = self._forward("decode", self._decode_logits)(run.state.root[:, None])
            with timer.phase("accept"):
                emitted, kept = self._tail(run, "plain", logits)
            if index is not None:
                run.nodes.append(1)
                run.options.append(self.budget.options[index].label)
                run.predicted.append(torch.ones((), device=kept.device))
        else:
            with timer.phase("draft"):
                draft, predicted, scoring = self._draft(run, index)
            with timer.phase("verify"):
                logits = self._verify_logits(run, draft.tokens, draft.mask, draft.depths)
            with timer.phase("accept"):
                inputs = (draft.tokens, draft.parents, draft.mask, draft.depths)
                if scoring is not None:  # under a budget: what AcceptanceStats.record takes (AdaptiveBudget.shape)
                    inputs += scoring
                emitted, kept = self._tail(run, "accept", logits, *inputs)
            run.nodes.append(draft.tokens.shape[1])
            if index is not None:
                run.options.append(self.budget.options[index].label)
            if predicted is not None:
                run.predicted.append(predicted.clone())  # a static graph output under graphs, like `kept`
        run.history.append(kept.clone())  # under graphs `kept` is the tail's static output, rewritten next round
        if streamer is not None:
            streamer(emitted, kept)

    def _choose(self, run: Run) -> Optional[int]:
        """The budget's option for this round (None: the fixed tree), from what the last sync read."""
        if self.budget is None:
            return None
        return self.budget.choose(run.context, run.state.root.shape[0], run.realised, run.seen,
                                  run.stats.exploration, tail_label(run.params))

    def _draft(self, run: Run, index: Optional[int]) -> tuple[DraftTree, Optional[Tensor], Optional[tuple]]:
        """The round's complete tree, and under a budget its option's realised tau and what the tail's
        :meth:`~longspec.decode.budget.AcceptanceStats.record` takes besides the acceptance (the nodes' statistics
        cells and the option scoring, from :meth:`~longspec.decode.budget.AdaptiveBudget.shape`): the drafter's
        tree, or the budget's option ``index`` of it. Under CUDA graphs when enabled and the drafter offers
        ``graph_state``: one graph per option, captured on its first round of each generate call."""
        plain = index is not None and self.budget.options[index].spec is None
        if plain and not hasattr(self.drafter, "observe"):
            run.stale = True  # it will miss this round's tokens
        elif not plain and run.stale:
            self.drafter.prefill(run.state, self.tree)  # may reallocate its state: recapture its graphs
            run.dropped_capture_s += sum(g.capture_s for g in run.draft_graphs.values())
            run.stale, run.draft_graphs = False, {}
        fn = functools.partial(self._draft_body, run, index)
        if not (self.cuda_graphs and hasattr(self.drafter, "graph_state") and run.state.root.is_cuda):
            return fn()
        if index not in run.draft_graphs:
            mutated = self.drafter.graph_state() + (run.stats.tensors() if run.stats is not None else [])
            run.draft_graphs[index] = CapturedDraft(fn, mutated)
        return run.draft_graphs[index]()

    def _draft_body(self, run: Run, index: Optional[int]) -> tuple[DraftTree, Optional[Tensor], Optional[tuple]]:
        state = run.state
        if index is None:
            return complete_tree(self._propose_fn(state, self.tree), self.tree), None, None
        spec = self.budget.options[index].spec
        if spec is None:  # a plain round: the root alone (it scores no option); the drafter only catches up
            if hasattr(self.drafter, "observe"):
                self.drafter.observe(state, self.tree)
            tree = root_tree(state.root)
            return tree, torch.ones((), device=state.root.device), (tree.depths,
                                                                     *run.stats.blank(state.root.shape[0], 1,
                                                                                      state.root.device))
        pool = complete_tree(self._propose_fn(state, spec), spec)
        return self.budget.shape(run.stats, pool, index, state.active)

    def _verify_logits(self, run: Run, tokens: Tensor, mask: Tensor, depths: Tensor) -> Tensor:
        """Target logits ``[B, T, V]`` at every node of the tree ``tokens`` (int64 ``[B, T]``) under ``mask``, its
        nodes at depths ``depths`` (int64 ``[B, T]``)."""
        if self.kv_update is KVUpdate.REFEED:
            pending = run.state.tokens.gather(1, self._pending_columns(run))
            return self._forward("verify", self._refeed_tree_logits)(pending, run.pending, tokens, mask, depths)
        return self._forward("verify", self._tree_logits)(tokens, mask, depths)

    def _tail(self, run: Run, name: str, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        """The round's tail (``_accept_tail`` or ``_plain_tail``): draws, stops, commit and state update.

        Returns ``(emitted [B, A], kept [B])``. Under CUDA graphs it is captured on the first round of the call,
        with every row marked inactive while the warm-up runs (so they keep nothing, commit nothing and move no
        state), and replayed from then on; ``logits`` is then the forward graph's static output, the same tensor
        every round.
        """
        if not (self.cuda_graphs and logits.is_cuda):
            return self._tail_body(name, run, logits, *inputs)
        key = (name, logits.shape[1])  # one per tree size: each verify graph has its own static logits
        if key not in run.tails:
            gens = [g for g in (run.noise_generator,) if g is not None]
            run.tails[key] = CapturedCall(functools.partial(self._tail_body, name, run, logits), generators=gens)
            active = run.state.active.clone()
            run.state.active.zero_()
            run.tails[key].capture(*inputs)
            run.state.active.copy_(active)
        return run.tails[key](*inputs)

    def _tail_body(self, name: str, run: Run, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        state, generator = run.state, run.noise_generator
        fns = self._tail_fns if generator is None else TAIL  # torch.compile cannot take a torch.Generator
        remaining = run.max_new - run.generated
        # the seed travels as data (run.seed), so the tail's compiled graph serves every seed
        params = run.params if run.params.seed is None else dataclasses.replace(run.params, seed=0)
        emitted, kept, finished, accept_index, accept_len = fns[name](
            logits, *inputs[:4], params, self.tree.depth, state.seqlens, run.eos, remaining, state.active, generator,
            run.seed)
        if accept_index is not None:
            if run.stats is not None:
                run.stats.record(*inputs[4:], accept_index, accept_len, state.active)
            self._commit(run, accept_index, kept)
        fns["advance"](state.tokens, state.root, state.seqlens, run.generated, state.active, emitted, kept, finished)
        if run.report is not None:
            _write_report(run)
        return emitted, kept

    def _commit(self, run: Run, accept_index: Tensor, kept: Tensor) -> None:
        """Compact root + accepted drafts into rows ``seqlens + [0, kept)``: every layer (COMMIT) or the last (REFEED)."""
        cache = run.state.cache
        if self.kv_update is KVUpdate.COMMIT:
            torch.ops.longspec.commit_kv_(cache.planes(), cache.seqlens, accept_index.to(torch.int32), kept.to(torch.int32))
            return
        # the tree sat behind the R re-fed slots: node i at row (seqlens - pending) + R + i
        shift = (self.tree.depth + 1 - run.pending)[:, None]
        torch.ops.longspec.commit_kv_(cache.kv[-1], cache.seqlens, (accept_index + shift).to(torch.int32),
                                kept.to(torch.int32))
        run.pending.copy_(kept)

    def _pending_columns(self, run: Run) -> Tensor:
        """int64 ``[B, depth + 1]`` token-buffer columns of the path to re-feed (valid below ``run.pending``)."""
        start = run.state.seqlens.to(torch.int64) - run.pending
        return start[:, None] + torch.arange(self.tree.depth + 1, device=start.device)

    def _scratch_rows(self) -> int:
        """Cache rows past the committed length that one decode / verify step writes."""
        if self.drafter is None:
            return 1
        if self.kv_update is KVUpdate.REFEED:
            return self.tree.num_nodes + self.tree.depth + 1
        return self.tree.num_nodes

    # -- target forwards (the capturable parts) -------------------------------------------------------------------

    def _decode_logits(self, root: Tensor) -> Tensor:
        with self._numerics():
            hidden = forward_extend(self.target, self._cache, root, invariant=self._invariant is not None)
            return lm_logits(self.target, hidden)

    def _tree_logits(self, tokens: Tensor, mask: Tensor, depths: Tensor) -> Tensor:
        positions = tree_positions(self._cache.seqlens, depths)
        with self._numerics():
            hidden = forward_tree(self.target, self._cache, tokens, positions, mask,
                                  invariant=self._invariant is not None)
            return lm_logits(self.target, hidden)

    def _numerics(self) -> contextlib.AbstractContextManager:
        """The target's invariant linears and norms for one forward (Numerics.INVARIANT), else nothing."""
        return self._invariant.active() if self._invariant is not None else contextlib.nullcontext()

    def _refeed_tree_logits(self, pending: Tensor, pending_len: Tensor, tokens: Tensor, mask: Tensor,
                            depths: Tensor) -> Tensor:
        """REFEED verify: ``[pending path (R slots) | tree]`` over the rows every layer holds; tree logits only."""
        cache, R = self._cache, pending.shape[1]
        held = cache.seqlens - pending_len.to(torch.int32)  # rows valid in every layer
        ids = torch.cat([pending, tokens], dim=1)
        positions = torch.cat([held.to(torch.int64)[:, None] + torch.arange(R, device=ids.device),
                               tree_positions(cache.seqlens, depths)], dim=1)
        full_mask = prefix_tree_mask(pending_len, R, mask)
        hidden = forward_tree(self.target, cache, ids, positions, full_mask, seqlens=held)
        return lm_logits(self.target, hidden[:, R:])

    def _forward(self, name: str, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """``fn`` itself, or its CUDA graph (captured once per decoder and input shapes) under ``cuda_graphs``."""
        if not self.cuda_graphs or self._cache.kv.device.type != "cuda":
            return fn
        if name not in self._graphs:
            self._graphs[name] = CapturedCall(fn)
        return self._graphs[name]

    def _cache_for(self, batch: int, rows: int) -> StaticKVCache:
        """Reuse the cache when it fits (CUDA graphs captured on it stay valid); otherwise allocate a new one."""
        if self.max_cache_len is not None and rows > self.max_cache_len:
            raise ValueError(f"the request needs {rows} cache rows (prompt + max_new_tokens + scratch rows for one "
                             f"verify step), more than max_cache_len={self.max_cache_len}")
        dtype, device = self.target.dtype, self.target.get_output_embeddings().weight.device
        cache = self._cache
        if cache is None or cache.batch_size != batch or cache.max_len < rows or cache.kv.dtype != dtype:
            rows = -(-rows // 256) * 256  # round up so later requests can reuse it
            if self.max_cache_len is not None:
                rows = min(rows, self.max_cache_len)
            cache = StaticKVCache.from_config(self.target.config, batch, rows, dtype, device, tp=self.tp)
            self._cache, self._graphs = cache, {}
        cache.seqlens.zero_()
        return cache


# -- helpers --------------------------------------------------------------------------------------------------------


def _check_numerics(numerics: Numerics, kv_update: KVUpdate, tp) -> None:
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics must be a Numerics (Numerics.FAST or Numerics.INVARIANT), got {numerics!r}")
    if numerics is Numerics.INVARIANT and kv_update is not KVUpdate.COMMIT:
        raise ValueError("Numerics.INVARIANT needs kv_update=KVUpdate.COMMIT: a re-fed path is attended as new "
                         "tokens, not as the committed rows plain decoding reads")
    if numerics is Numerics.INVARIANT and tp is not None:
        raise ValueError("Numerics.INVARIANT does not support a tensor-parallel target (its sharded linears and "
                         "all-reduces are not batch-invariant)")


def _write_report(run: Run) -> None:
    """What the next sync reads under a budget, in one float32 tensor: ``[active (B), seqlens (B), realised (K),
    seen (K)]`` (written by the round's tail, inside its graph)."""
    state, stats = run.state, run.stats
    torch.cat([state.active.float(), state.seqlens.float(), stats.realised, stats.seen.float()], out=run.report)


def _check_drafter(target: torch.nn.Module, drafter: Optional[Drafter], kv_update: KVUpdate) -> None:
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must implement the Drafter protocol (prefill, propose), got {type(drafter).__name__}")
    draft_vocab = getattr(drafter, "vocab_size", None)
    target_vocab = target.get_output_embeddings().out_features
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise ValueError(f"the drafter's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")
    if not isinstance(kv_update, KVUpdate):
        raise TypeError(f"kv_update must be a KVUpdate, got {kv_update!r}")
    if kv_update is KVUpdate.REFEED and getattr(drafter, "reads_all_target_layers", True) and drafter is not None:
        raise ValueError(f"KVUpdate.REFEED keeps only the target's last layer current between rounds, but "
                         f"{type(drafter).__name__} reads every layer (reads_all_target_layers); use KVUpdate.COMMIT")
