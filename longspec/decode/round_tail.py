"""The round tail as the decoder runs it: :mod:`~longspec.decode.tail`'s functions (compiled when asked) with the
acceptance statistics, the accepted path's commit and the budget's report, captured as one CUDA graph per tree
size and sampling setting in the run's slot."""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from .drafter import TreeSpec
from .graphs import CapturedCall
from .modes import KVUpdate
from .run import Run, write_report
from .tail import TAIL


class RoundTail:
    """Draws, acceptance, stops, commit and state update of a round, for one decoder's ``tree`` and ``kv_update``;
    ``compiled``: ``torch.compile`` the tail functions (not the generator-drawn ones: torch.compile cannot take a
    ``torch.Generator``)."""

    def __init__(self, tree: TreeSpec, kv_update: KVUpdate, cuda_graphs: bool, compiled: bool) -> None:
        self.tree, self.kv_update, self.cuda_graphs, self.compiled = tree, kv_update, cuda_graphs, compiled
        self.fns = {name: torch.compile(fn, fullgraph=True) for name, fn in TAIL.items()} if compiled else TAIL

    def __call__(self, run: Run, name: str, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        """The round's tail ``name`` (``"accept"`` or ``"plain"``): draws, stops, commit and state update.

        Returns ``(emitted [B, A], kept [B])``. Under CUDA graphs it is captured on the slot's first round of this
        tree size and sampling setting, with every row marked inactive while the warm-up runs (so they keep
        nothing, commit nothing and move no state), and replayed from then on; ``logits`` is then the forward
        graph's static output, the same tensor every round.
        """
        if not (self.cuda_graphs and logits.is_cuda):
            if self.compiled:  # one compile for every layout the tree's tensors come in
                inputs = tuple(t.contiguous() for t in inputs)
            return self._body(name, run, logits, *inputs)
        p, gens = run.params, tuple(g for g in (run.noise_generator,) if g is not None)
        # what the captured code bakes in: the tree size (each verify graph has its own static logits), the
        # sampling filters, whether the draws are seeded (the seed itself is data) or from a generator
        key = (name, logits.shape[1], p.greedy or (p.temperature, p.top_k, p.top_p, p.seed is not None), bool(gens))
        tail = run.slot.tails.get(key)
        if tail is None or tail.generators != gens:  # another generator object: its state is not the graph's
            run.slot.drop({key: run.slot.tails.pop(key)} if tail is not None else {})
            tail = run.slot.tails[key] = CapturedCall(functools.partial(self._body, name, run, logits),
                                                      generators=gens)
            active = run.state.active.clone()
            run.state.active.zero_()
            tail.capture(*inputs)
            run.state.active.copy_(active)
        return tail(*inputs)

    def _body(self, name: str, run: Run, logits: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        state, generator = run.state, run.noise_generator
        fns = self.fns if generator is None else TAIL  # torch.compile cannot take a torch.Generator
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

    def pending_columns(self, run: Run) -> Tensor:
        """int64 ``[B, depth + 1]`` token-buffer columns of the path to re-feed (valid below ``run.pending``)."""
        start = run.state.seqlens.to(torch.int64) - run.pending
        return start[:, None] + torch.arange(self.tree.depth + 1, device=start.device)


__all__ = ["RoundTail"]
