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
import dataclasses
import functools
import time
import warnings
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

from . import calibration, warmup
from .budget import AdaptiveBudget, CostModel, root_tree, sampling_key, tail_label
from .drafter import DecodeState, Drafter, DraftTree, TreeSpec
from .graphs import CapturedCall, CapturedDraft
from .modes import KVUpdate, Numerics, check_drafter, check_numerics
from .prompt import Prompt, eos_ids, output_sequences, pad_id, prepare_prompt
from .run import GenerateOutput, Run, write_report
from .sampling import SamplingParams, sample_tokens
from .slot import Slot
from .stats import PhaseTimer, accept_lengths, collect_stats
from .tail import TAIL
from .tree import complete_tree, prefix_tree_mask, tree_positions

Streamer = Callable[[Tensor, Tensor], None]


class SpeculativeDecoder:
    """Lossless speculative decoding for a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3).

    Args:
        target: the model to decode (any dtype/device; it is run in eval semantics under ``inference_mode``).
        drafter: a :class:`~longspec.decode.drafter.Drafter` or None for plain decoding on the same kernels.
        tree_shape: nodes per depth (``(4, 16, 16, 16, 16)``: 69 nodes with the root; a chain is ``(1, 1, 1, 1)``),
            or a :class:`~longspec.decode.drafter.TreeSpec` (``TreeSpec.merged(...)`` for a
            :class:`~longspec.decode.merge.MergedDrafter`).
        cuda_graphs: replay every round from CUDA graphs (CUDA only): the target's decode / verify forwards
            the drafter's ``propose`` when it offers ``graph_state()`` (all three built-in drafters do) and the
            round's tail: each captured on its first round of a batch size and kept across calls (:meth:`warmup`
            captures them up front).
        compile: ``torch.compile`` the target's decoder layers (:class:`~longspec.model.target.CompiledTarget`),
            the drafter's ``propose`` when it declares ``compilable = True`` (the LongSpec and prompt-lookup
            drafters do) and the round's tail. The first round of each new shape waits for the compile (seconds
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

    The decoder keeps its KV cache and round state between ``generate`` calls, one
    :class:`~longspec.decode.slot.Slot` per batch size warmed up (and one more for the last other batch size), reused
    while big enough so that captured CUDA graphs and compiled code stay valid; one decoder serves one call at a
    time.

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
        self._slots: dict[int, Slot] = {}  # batch size -> its persistent state and graphs
        self._last: Optional[Slot] = None  # the slot of the last call
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
        """A run over ``context`` committed rows of random K/V and random tokens, with no prefill, room for
        ``rounds`` more rounds and no stop: what the step benchmarks time (a round's cost depends on the committed
        length, the shapes and the sampling settings, not on the values). Greedy unless ``params``; unseeded
        sampling runs seeded here (its draws come from a counter instead of a ``torch.Generator``: the same filters
        and about the same work) unless ``as_given`` (then from the default generator). Drive it with
        :meth:`step`."""
        device = self.target.get_output_embeddings().weight.device
        max_new = rounds * (self.tree.depth + 1) + 1
        vocab = self.target.get_output_embeddings().weight.shape[0]
        params = SamplingParams() if params is None else params
        if not params.greedy and params.seed is None and not as_given:
            params = dataclasses.replace(params, seed=seed)
        with torch.inference_mode(), use_longspec_attention(self.target):  # the slot may hold inference tensors
            slot = self._slot_for(batch, context + max_new + self._scratch_rows())
            gen = torch.Generator(device=device).manual_seed(seed)
            slot.cache.kv.normal_(generator=gen)
            slot.tokens.random_(0, vocab, generator=gen)
            lens = torch.full((batch,), context, dtype=torch.int64, device=device)
            no_stop = torch.zeros(0, dtype=torch.int64, device=device)
            return self._begin(slot, lens, slot.tokens[:, context].clone(), params, no_stop, max_new, None)

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
        ``a + b * context``. Runs outside ``generate``; the graphs it captures serve later calls
        (:mod:`~longspec.decode.calibration`)."""
        return calibration.calibrate(self, batch, contexts, reps, params)

    @property
    def _cache(self) -> Optional[StaticKVCache]:
        """The last call's KV cache (tests and benchmarks read its geometry)."""
        return self._last.cache if self._last is not None else None

    # -- phases ---------------------------------------------------------------------------------------------------

    def _start(self, prompt: Prompt, params: SamplingParams, eos: Tensor, max_new: int,
               generator: Optional[torch.Generator]) -> Run:
        """Copy the request into its slot, prefill, sample the first token and let the drafter prefill."""
        B, S = prompt.tokens.shape
        slot = self._slot_for(B, prompt.max_len + max_new + self._scratch_rows())
        slot.tokens.zero_()
        slot.tokens[:, :S] = prompt.tokens
        logits = self._prefill_logits(slot.cache, prompt)
        root = sample_tokens(logits, params, prompt.lens[:, None], generator)[:, 0]
        return self._begin(slot, prompt.lens, root, params, eos, max_new, generator)

    def _begin(self, slot: Slot, lens: Tensor, root: Tensor, params: SamplingParams, eos: Tensor, max_new: int,
               generator: Optional[torch.Generator]) -> Run:
        """The run after the prefill: ``lens`` committed rows per row, ``root`` pending; the drafter prefills."""
        cache = slot.cache
        self.tree.depth_tensor(cache.kv.device)  # made here, outside any graph capture
        cache.seqlens.copy_(lens.to(torch.int32))
        slot.root.copy_(root)
        slot.tokens.scatter_(1, lens[:, None], root[:, None])
        slot.active.copy_(~(root[:, None] == eos).any(dim=-1) & (max_new > 1))
        slot.generated.fill_(1)
        slot.pending.zero_()
        slot.max_new.fill_(max_new)
        slot.set_eos(eos)
        if params.seed is not None:
            slot.set_seed(params.seed)
        state = DecodeState(self.target, cache, slot.tokens, slot.root, slot.active, max_depth=self.tree.depth)
        run = Run(slot, state, params, max_new, generator)
        if self.budget is not None:
            run.stats = self.budget.stats_for(sampling_key(params), root.device)
            write_report(run)
        if self.drafter is not None:
            self.drafter.prefill(state, self.tree)
        return run

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
        # under a budget: the report the round's tail wrote (write_report), so no op runs eagerly here
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
                logits = self._forward(run, "decode")(run.state.root[:, None])
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
        ``graph_state``: one graph per option (and sampling setting, under a budget) in the slot, captured on its
        first round and recaptured only if the drafter's state moved."""
        plain = index is not None and self.budget.options[index].spec is None
        if plain and not hasattr(self.drafter, "observe"):
            run.stale = True  # it will miss this round's tokens
        elif not plain and run.stale:
            self.drafter.prefill(run.state, self.tree)
            run.stale = False
        fn = functools.partial(self._draft_body, run, index)
        if not (self.cuda_graphs and hasattr(self.drafter, "graph_state") and run.state.root.is_cuda):
            return fn()
        mutated = self.drafter.graph_state() + (run.stats.tensors() if run.stats is not None else [])
        key = (index, sampling_key(run.params) if run.stats is not None else None)  # the stats it reads
        graph = run.slot.drafts.get(key)
        if graph is None or not graph.valid_for(mutated):
            run.slot.drop({key: run.slot.drafts.pop(key)} if graph is not None else {})
            graph = run.slot.drafts[key] = CapturedDraft(fn, mutated)
        return graph()

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
            return self._forward(run, "refeed")(pending, run.pending, tokens, mask, depths)
        return self._forward(run, "verify")(tokens, mask, depths)

    def _tail(self, run: Run, name: str, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        """The round's tail (``_accept_tail`` or ``_plain_tail``): draws, stops, commit and state update.

        Returns ``(emitted [B, A], kept [B])``. Under CUDA graphs it is captured on the slot's first round of this
        tree size and sampling setting, with every row marked inactive while the warm-up runs (so they keep
        nothing, commit nothing and move no state), and replayed from then on; ``logits`` is then the forward
        graph's static output, the same tensor every round.
        """
        if not (self.cuda_graphs and logits.is_cuda):
            if self._compiled is not None:  # one compile for every layout the tree's tensors come in
                inputs = tuple(t.contiguous() for t in inputs)
            return self._tail_body(name, run, logits, *inputs)
        p, gens = run.params, tuple(g for g in (run.noise_generator,) if g is not None)
        # what the captured code bakes in: the tree size (each verify graph has its own static logits), the
        # sampling filters, whether the draws are seeded (the seed itself is data) or from a generator
        key = (name, logits.shape[1], p.greedy or (p.temperature, p.top_k, p.top_p, p.seed is not None), bool(gens))
        tail = run.slot.tails.get(key)
        if tail is None or tail.generators != gens:  # another generator object: its state is not the graph's
            run.slot.drop({key: run.slot.tails.pop(key)} if tail is not None else {})
            tail = run.slot.tails[key] = CapturedCall(functools.partial(self._tail_body, name, run, logits),
                                                      generators=gens)
            active = run.state.active.clone()
            run.state.active.zero_()
            tail.capture(*inputs)
            run.state.active.copy_(active)
        return tail(*inputs)

    def _tail_body(self, name: str, run: Run, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        state, generator = run.state, run.noise_generator
        fns = self._tail_fns if generator is None else TAIL  # torch.compile cannot take a torch.Generator
        remaining = run.slot.max_new - run.generated
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
            write_report(run)
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

    def _decode_logits(self, cache: StaticKVCache, root: Tensor) -> Tensor:
        with self._numerics():
            hidden = forward_extend(self.target, cache, root, invariant=self._invariant is not None)
            return lm_logits(self.target, hidden)

    def _tree_logits(self, cache: StaticKVCache, tokens: Tensor, mask: Tensor, depths: Tensor) -> Tensor:
        positions = tree_positions(cache.seqlens, depths)
        with self._numerics():
            hidden = forward_tree(self.target, cache, tokens, positions, mask, invariant=self._invariant is not None)
            return lm_logits(self.target, hidden)

    def _numerics(self) -> contextlib.AbstractContextManager:
        """The target's invariant linears and norms for one forward (Numerics.INVARIANT), else nothing."""
        return self._invariant.active() if self._invariant is not None else contextlib.nullcontext()

    def _refeed_tree_logits(self, cache: StaticKVCache, pending: Tensor, pending_len: Tensor, tokens: Tensor,
                            mask: Tensor, depths: Tensor) -> Tensor:
        """REFEED verify: ``[pending path (R slots) | tree]`` over the rows every layer holds; tree logits only."""
        R = pending.shape[1]
        held = cache.seqlens - pending_len.to(torch.int32)  # rows valid in every layer
        ids = torch.cat([pending, tokens], dim=1)
        positions = torch.cat([held.to(torch.int64)[:, None] + torch.arange(R, device=ids.device),
                               tree_positions(cache.seqlens, depths)], dim=1)
        full_mask = prefix_tree_mask(pending_len, R, mask)
        hidden = forward_tree(self.target, cache, ids, positions, full_mask, seqlens=held)
        return lm_logits(self.target, hidden[:, R:])

    def _forward(self, run: Run, name: str) -> Callable[..., Tensor]:
        """The target forward ``name`` (decode / verify / refeed) on the run's cache, or its CUDA graph (captured
        once per slot and input shapes) under ``cuda_graphs``."""
        fn = {"decode": self._decode_logits, "verify": self._tree_logits, "refeed": self._refeed_tree_logits}[name]
        if not self.cuda_graphs or run.slot.cache.kv.device.type != "cuda":
            return functools.partial(fn, run.slot.cache)
        if name not in run.slot.forwards:
            run.slot.forwards[name] = CapturedCall(functools.partial(fn, run.slot.cache))
        return run.slot.forwards[name]

    def _slot_for(self, batch: int, rows: int, pin: bool = False) -> Slot:
        """The slot of this batch size, reused when its cache fits ``rows`` (its graphs and compiled code stay
        valid); otherwise a new one. Slots made by :meth:`warmup` (``pin``) are kept; of the others only the
        last is."""
        if self.max_cache_len is not None and rows > self.max_cache_len:
            raise ValueError(f"the request needs {rows} cache rows (prompt + max_new_tokens + scratch rows for one "
                             f"verify step), more than max_cache_len={self.max_cache_len}")
        dtype, device = self.target.dtype, self.target.get_output_embeddings().weight.device
        slot = self._slots.get(batch)
        if slot is None or slot.cache.max_len < rows or slot.cache.kv.dtype != dtype:
            pinned = pin or (slot is not None and slot.pinned)
            if slot is not None and slot.pinned and not pin:
                warnings.warn(f"a request of batch {batch} needs {rows} cache rows, more than warmup() prepared "
                              f"({slot.cache.max_len}): the cache is reallocated and its graphs captured again "
                              f"(warm up with a larger max_context)", stacklevel=3)
            if not pinned:  # one slot for the batch sizes nobody warmed up
                self._slots = {b: s for b, s in self._slots.items() if s.pinned}
            rows = -(-rows // 256) * 256  # round up so later requests can reuse it
            if self.max_cache_len is not None:
                rows = min(rows, self.max_cache_len)
            report = 2 * batch + 2 * len(self.budget.options) if self.budget is not None else 0
            vocab = self.target.get_output_embeddings().weight.shape[0]
            slot = Slot.allocate(self.target.config, batch, rows, self.tree.depth, vocab, report, dtype, device,
                                 tp=self.tp)
            slot.pinned = pinned
            # a later, longer request needs a wider buffer: one dynamic dimension, not one compile per width
            torch._dynamo.maybe_mark_dynamic(slot.tokens, 1)
            self._slots[batch] = slot
        slot.pinned = slot.pinned or pin
        slot.cache.seqlens.zero_()
        self._last = slot
        return slot


__all__ = ["GenerateOutput", "KVUpdate", "Numerics", "SpeculativeDecoder"]
