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
``propose``, the target forward, and the *tail* (draws, acceptance, stops, ``commit_kv_`` and the state update),
each captured once per batch size on the tensors of a :class:`~longspec.decode.slot.Slot` that outlives the call;
:meth:`SpeculativeDecoder.warmup` captures them (and compiles, and calibrates a budget) before the first request.
With ``compile=True`` the target's layers (:class:`~longspec.model.target.CompiledTarget`), the drafter's
``propose`` and the tail are ``torch.compile``d, so each replays as a few fused kernels per layer instead of
dozens of small ones.

Sampling is :func:`~longspec.decode.sampling.sample_tokens` for both paths; with a ``seed`` the speculative output
equals plain decoding's token for token.
"""
from __future__ import annotations

import contextlib
import functools
import time
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
    use_longspec_attention,
)

from . import calibration, warmup
from .budget import AdaptiveBudget, CostModel, sampling_key, tail_label
from .draft_step import DraftStep
from .drafter import DecodeState, Drafter, TreeSpec
from .forwards import TargetForwards
from .modes import KVUpdate, Numerics, check_drafter, check_numerics, check_settings
from .prompt import Prompt, eos_ids, output_sequences, pad_id, prepare_prompt
from .round_tail import RoundTail
from .run import GenerateOutput, Run, write_report
from .sampling import SamplingParams, sample_tokens
from .slot import Slot, SlotPool
from .stats import PhaseTimer, accept_lengths, collect_stats

Streamer = Callable[[Tensor, Tensor], None]


# Inductor settings of the compiled draft step. Combo kernels launch independent small kernels (a level's RoPE,
# cache writes, mask rows, ...) as one: the shipped pair's step 390 -> 346 us on an H200, Llama-3-8B's (float8,
# 32k vocabulary) 1211 -> 1168 us (benchmarks/results/h200/NOTES.md, 2026-12-05). Only the draft step: a drafter's
# numerics cannot change the output (verification decides every token), while the target's and the tail's can.
DRAFT_INDUCTOR_OPTIONS = {"combo_kernels": True}


class SpeculativeDecoder:
    """Lossless speculative decoding for a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3).

    Args:
        target: the model to decode (any dtype/device; it is run in eval semantics under ``inference_mode``).
        drafter: a :class:`~longspec.decode.drafter.Drafter` or None for plain decoding on the same kernels.
        tree_shape: nodes per depth (``(4, 16, 16, 16, 16)``: 69 nodes with the root; a chain is ``(1, 1, 1, 1)``),
            or a :class:`~longspec.decode.drafter.TreeSpec` (``TreeSpec.merged(...)`` for a
            :class:`~longspec.decode.merge.MergedDrafter`).
        cuda_graphs: replay every round from CUDA graphs (CUDA only): the target's decode / verify forwards,
            the drafter's ``propose`` (and ``observe`` in a budget's plain rounds) when it offers ``graph_state()``
            (all three built-in drafters do) and the round's tail: each captured on its first round of a batch
            size and kept across calls (:meth:`warmup` captures them up front).
        compile: ``torch.compile`` the target's decoder layers (:class:`~longspec.model.target.CompiledTarget`),
            the drafter's ``propose`` and ``observe`` when it declares ``compilable = True`` (the LongSpec and
            prompt-lookup drafters do; a :class:`~longspec.decode.merge.MergedDrafter`'s parts through its
            ``compiled_calls``)
            and the round's tail. The first round of each new shape waits for the compile (seconds
            per compiled function; torch.compile caches the results on disk, so later processes wait less);
            :meth:`warmup` compiles every shape a request can have up front.
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

    The decoder keeps its KV cache and round state between calls (:class:`~longspec.decode.slot.SlotPool`: one
    slot per batch size warmed up, one for the last other), so graphs and compiled code stay valid; one decoder
    serves one call at a time.

    Example::

        >>> dec = SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(1, 1, 1, 1))
        >>> dec.warmup(batch_sizes=(1,), max_context=8192)               # optional: no capture or compile later
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
        check_drafter(target, drafter, kv_update)
        check_numerics(numerics, kv_update, self.tp)
        self.numerics = numerics
        check_settings(prefill_chunk_size, budget, drafter)
        self.target = target
        self.kv_update = kv_update
        self.drafter = drafter
        self.tree = tree_shape if isinstance(tree_shape, TreeSpec) else TreeSpec(tuple(tree_shape))
        if budget is not None:
            budget.bind(self.tree)
        self.budget = budget
        self.cuda_graphs = bool(cuda_graphs)
        self.prefill_chunk_size = prefill_chunk_size
        self.max_cache_len = max_cache_len
        self.phase_times = bool(phase_times)
        invariant = InvariantTarget(target) if numerics is Numerics.INVARIANT else None
        self._forwards = TargetForwards(target, invariant, self.cuda_graphs, prefill_chunk_size)
        # batch size -> its persistent state and graphs
        self._slots = SlotPool(target, self.tree.depth, 2 * len(budget.options) if budget is not None else 0,
                               max_cache_len, self.tp)
        self._compiled = CompiledTarget(target) if compile else None
        self._propose_fn = drafter.propose if drafter is not None else None
        observe = getattr(drafter, "observe", None)
        if compile and drafter is not None:
            compile_fn = functools.partial(torch.compile, fullgraph=True, options=DRAFT_INDUCTOR_OPTIONS)
            if getattr(drafter, "compilable", False):
                self._propose_fn = compile_fn(drafter.propose)
                observe = compile_fn(observe) if observe is not None else None
            elif hasattr(drafter, "compiled_calls"):  # a merged drafter: its parts compiled, the merge as it is
                self._propose_fn, observe = drafter.compiled_calls(compile_fn)
        self._tail = RoundTail(self.tree, kv_update, self.cuda_graphs, compile)
        self._draft_step = DraftStep(drafter, self.tree, budget, self._propose_fn, observe, self.cuda_graphs)

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
            calibration.ensure_costs(self, prompt.tokens.shape[0], total, params)
        t0 = time.perf_counter()
        with torch.inference_mode(), use_longspec_attention(self.target):
            run = self._start(prompt, params, eos, max_new_tokens, generator)
            held = run.slot.capture_seconds(), run.slot.captures()  # the graphs held before the rounds
            if streamer is not None:
                streamer(run.state.root[:, None], torch.ones_like(run.generated))
            with self._compiled_layers():
                t1 = self._rounds(run, timer, streamer)
            sequences = output_sequences(input_ids.to(device), prompt, run.state.tokens, run.generated,
                                         pad_id(self.target, eos))
        t2 = time.perf_counter()
        stats = collect_stats(run.history, run.generated, timer, t1 - t0, t2 - t1, run.nodes, run.predicted,
                              run.slot.capture_seconds() - held[0], run.options, run.slot.captures() - held[1])
        return GenerateOutput(sequences, accept_lengths(run.history, run.generated.shape[0]), stats)

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_context: Optional[int] = None,
               temperatures: Sequence[float] = (0.0,), top_k: int = 0, top_p: float = 1.0, seeded: bool = False,
               progress: bool = True) -> "warmup.WarmupReport":
        """Prepare every request of up to ``max_context`` tokens (prompt + ``max_new_tokens``) for each batch size
        in ``batch_sizes``: allocate its cache and state once, compile (``compile=True``), calibrate the budget's
        costs (when it has none for these settings) and capture every graph a round can replay (each budget
        option's draft, the decode / verify forwards, each round tail) for each of ``temperatures`` (0: greedy)
        with ``top_k`` / ``top_p``, seeded (``seed=``) or drawn from the default generator. Afterwards no
        ``generate`` within those settings captures or compiles (``DecodeStats.captures == 0``). A tqdm bar shows
        the steps (``progress=False``: none). Returns a :class:`~longspec.decode.warmup.WarmupReport` (seconds per
        part, memory held)."""
        return warmup.warmup(self, batch_sizes, max_context, temperatures, top_k, top_p, seeded, progress)

    def synthetic_run(self, context: int, batch: int = 1, rounds: int = 64, seed: int = 0,
                      params: Optional[SamplingParams] = None, as_given: bool = False) -> Run:
        """A run over ``context`` committed rows of random K/V and tokens, no prefill, room for ``rounds`` rounds, no
        stop: what the step benchmarks time. Greedy unless ``params``; unseeded sampling runs seeded (a counter,
        about the same work) unless ``as_given``. Drive it with :meth:`step`."""
        return calibration.synthetic_run(self, context, batch, rounds, seed, params, as_given)

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
        ``contexts`` on a synthetic run (greedy or the sampling ``params``), split into draft and verify + tail,
        each fitted as ``a + b * context`` (:mod:`~longspec.decode.calibration`)."""
        return calibration.calibrate(self, batch, contexts, reps, params)

    @property
    def _cache(self) -> Optional[StaticKVCache]:
        """The last call's KV cache (tests and benchmarks read its geometry)."""
        return self._slots.last.cache if self._slots.last is not None else None

    # -- phases ---------------------------------------------------------------------------------------------------

    def _start(self, prompt: Prompt, params: SamplingParams, eos: Tensor, max_new: int,
               generator: Optional[torch.Generator]) -> Run:
        """Copy the request into its slot, prefill, sample the first token and let the drafter prefill."""
        B, S = prompt.tokens.shape
        slot = self._slots.get(B, prompt.max_len + max_new + self._scratch_rows())
        slot.tokens.zero_()
        slot.tokens[:, :S] = prompt.tokens
        logits = self._forwards.prefill(slot.cache, prompt)
        root = sample_tokens(logits, params, prompt.lens[:, None], generator)[:, 0]
        return self._begin(slot, prompt.lens, root, params, eos, max_new, generator)

    def _begin(self, slot: Slot, lens: Tensor, root: Tensor, params: SamplingParams, eos: Tensor, max_new: int,
               generator: Optional[torch.Generator]) -> Run:
        """The run after the prefill: ``lens`` committed rows per row, ``root`` pending; the drafter prefills."""
        self.tree.depth_tensor(slot.cache.kv.device)  # made here, outside any graph capture
        slot.begin(lens, root, eos, max_new, params.seed)
        state = DecodeState(self.target, slot.cache, slot.tokens, slot.root, slot.active, max_depth=self.tree.depth)
        run = Run(slot, state, params, max_new, generator)
        if self.budget is not None:
            run.stats = self.budget.stats_for(sampling_key(params), root.device)
            write_report(run)
        if self.drafter is not None:
            self.drafter.prefill(state, self.tree)
        return run

    def _compiled_layers(self) -> contextlib.AbstractContextManager:
        return self._compiled.active() if self._compiled is not None else contextlib.nullcontext()

    def _rounds(self, run: Run, timer: PhaseTimer, streamer: Optional[Streamer]) -> float:
        """Run rounds until no row is active; returns when the prefill ended (``perf_counter``), i.e. its first read.

        Each round's one host read (whether any row is still active) is copied back asynchronously, and the host
        runs one round ahead: it enqueues round k + 1 before it waits for the read after round k, so the host's work
        between rounds (the read, the budget's choice, the launches) overlaps the device's instead of leaving it
        idle. When that read finds no active row, round k + 1 ran on finished rows only, where it emits, commits and
        moves nothing; its entries are dropped (its device time is the price of the overlap, once per call). The
        budget's choice for round k + 1 uses the statistics read after round k - 1.
        """
        read = run.read()
        alive = read()  # the first read ends the prefill
        t1 = time.perf_counter()
        if alive:
            self._round(run, timer, streamer)
            read = run.read()
        while alive:
            marks = (len(run.history), len(run.nodes), len(run.predicted), len(run.options))
            self._round(run, timer, streamer)  # round k + 1, enqueued before the read after round k is in
            after = run.read()
            alive = read()
            if not alive:
                del run.history[marks[0]:], run.nodes[marks[1]:], run.predicted[marks[2]:], run.options[marks[3]:]
            read = after
        return t1

    def _round(self, run: Run, timer: PhaseTimer, streamer: Optional[Streamer], option: Optional[int] = None) -> None:
        """One round on the device: [draft,] target forward, tail. No host sync (the caller reads ``active``).

        A plain round (no drafter, or a budget's plain option under ``KVUpdate.COMMIT``) is the decode forward and
        the plain tail: no tree, no scoring; a drafter sitting it out catches up (``observe``) or is marked stale."""
        index = None if self.drafter is None else self._choose(run) if option is None else option
        if self.drafter is None or (index is not None and self.budget.options[index].spec is None
                                    and self.kv_update is KVUpdate.COMMIT):
            if self.drafter is not None:  # it catches up (its observe, in the slot's graph) or is marked stale;
                with timer.phase("draft"):  # the step's root tree goes unused
                    self._draft_step(run, index)
            with timer.phase("verify"):
                logits = self._forwards.get(run.slot, "decode")(run.state.root[:, None])
            with timer.phase("accept"):
                emitted, kept = self._tail(run, "plain", logits)
            if index is not None:
                run.nodes.append(1)
                run.options.append(self.budget.options[index].label)
                run.predicted.append(torch.ones((), device=kept.device))
        else:
            with timer.phase("draft"):
                draft, predicted, scoring = self._draft_step(run, index)
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

    def _verify_logits(self, run: Run, tokens: Tensor, mask: Tensor, depths: Tensor) -> Tensor:
        """Target logits ``[B, T, V]`` at every node of the tree ``tokens`` (int64 ``[B, T]``) under ``mask``, its
        nodes at depths ``depths`` (int64 ``[B, T]``)."""
        if self.kv_update is KVUpdate.REFEED:
            pending = run.state.tokens.gather(1, self._tail.pending_columns(run))
            return self._forwards.get(run.slot, "refeed")(pending, run.pending, tokens, mask, depths)
        return self._forwards.get(run.slot, "verify")(tokens, mask, depths)

    def _scratch_rows(self) -> int:
        """Cache rows past the committed length that one decode / verify step writes."""
        if self.drafter is None:
            return 1
        if self.kv_update is KVUpdate.REFEED:
            return self.tree.num_nodes + self.tree.depth + 1
        return self.tree.num_nodes



__all__ = ["GenerateOutput", "KVUpdate", "Numerics", "SpeculativeDecoder"]
