"""A round's draft step as the decoder runs it: the drafter's tree (its ``propose``, compiled when asked), or under
an adaptive budget the chosen option cut from it, captured as one CUDA graph per option in the run's slot."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from .budget import AdaptiveBudget, root_tree, sampling_key
from .drafter import Drafter, DraftTree, TreeSpec
from .graphs import CapturedDraft
from .run import Run
from .tree import complete_tree


class DraftStep:
    """The draft step of one decoder: ``drafter`` over ``tree`` (``propose`` / ``observe``: its own or the compiled
    ones), cut by ``budget`` when given; under ``cuda_graphs`` replayed from the slot's graphs. A budget's plain
    option is a step too: the drafter catches up (``observe``) and the tree is the root alone."""

    def __init__(self, drafter: Optional[Drafter], tree: TreeSpec, budget: Optional[AdaptiveBudget],
                 propose: Optional[Callable], observe: Optional[Callable], cuda_graphs: bool) -> None:
        self.drafter, self.tree, self.budget = drafter, tree, budget
        self.propose, self.observe, self.cuda_graphs = propose, observe, cuda_graphs

    def __call__(self, run: Run, index: Optional[int]) -> tuple[DraftTree, Optional[Tensor], Optional[tuple]]:
        """The round's complete tree, and under a budget its option's realised tau and what the tail's
        :meth:`~longspec.decode.budget.AcceptanceStats.record` takes besides the acceptance (the nodes' statistics
        cells and the option scoring, from :meth:`~longspec.decode.budget.AdaptiveBudget.shape`): the drafter's
        tree, or the budget's option ``index`` of it. Under CUDA graphs when enabled and the drafter offers
        ``graph_state``: one graph per option (and sampling setting, under a budget) in the slot, captured on its
        first round and recaptured only if the drafter's state moved."""
        plain = index is not None and self.budget.options[index].spec is None
        if plain and self.observe is None:
            run.stale = True  # it will miss this round's tokens
        elif not plain and run.stale:
            self.drafter.prefill(run.state, self.tree)
            run.stale = False
        fn = functools.partial(self._body, run, index)
        if not (self.cuda_graphs and hasattr(self.drafter, "graph_state") and run.state.root.is_cuda):
            return fn()
        mutated = self.drafter.graph_state() + (run.stats.tensors() if run.stats is not None else [])
        key = (index, sampling_key(run.params) if run.stats is not None else None)  # the stats it reads
        graph = run.slot.drafts.get(key)
        if graph is None or not graph.valid_for(mutated):
            run.slot.drop({key: run.slot.drafts.pop(key)} if graph is not None else {})
            graph = run.slot.drafts[key] = CapturedDraft(fn, mutated)
        return graph()

    def _body(self, run: Run, index: Optional[int]) -> tuple[DraftTree, Optional[Tensor], Optional[tuple]]:
        state = run.state
        if index is None:
            return complete_tree(self.propose(state, self.tree), self.tree), None, None
        spec = self.budget.options[index].spec
        if spec is None:  # a plain round: the root alone (it scores no option); the drafter only catches up
            if self.observe is not None:
                self.observe(state, self.tree)
            tree = root_tree(state.root)
            return tree, torch.ones((), device=state.root.device), (tree.depths,
                                                                     *run.stats.blank(state.root.shape[0], 1,
                                                                                      state.root.device))
        pool = complete_tree(self.propose(state, spec), spec)
        return self.budget.shape(run.stats, pool, index, state.active)


__all__ = ["DraftStep"]
