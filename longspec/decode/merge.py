"""Merged drafters: one tree from several drafters' trees, deduplicated by prefix, verified in one forward.

A :class:`MergedDrafter` is a composition: each part proposes its own tree (its part of a merged
:class:`~longspec.decode.drafter.TreeSpec`), and :func:`merge_trees` lays them out as one tree. Level d of the
merged layout holds part 0's depth-d nodes, then part 1's, and so on (a static layout, so the merged tree has a
fixed size and replays from CUDA graphs). Two nodes with the same path from the root are one candidate: the first
(part 0 before part 1) stays, the later one's children move under it, and the later one stays in place as a
duplicate sibling with score -inf. Verification never takes a duplicate (it visits siblings in order and takes the
first match), and an adaptive budget prunes it first. The merged node remembers every part that proposed it
(``sources``, a bitmask), which is what the acceptance statistics are kept by.

Exactness holds as for any tree: the point-mass rule needs no draft probabilities, so whatever the parts propose,
the output is the target's.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .drafter import DecodeState, Drafter, DraftTree, TreeSpec
from .tree import complete_tree, tree_mask_from_parents


class MergedDrafter:
    """A :class:`~longspec.decode.drafter.Drafter` whose trees are the prefix-deduplicated union of its parts'.

    Use it with a merged tree shape, one shape per part::

        >>> drafter = MergedDrafter(LongSpecDrafter(draft), PromptLookupDrafter())
        >>> dec = SpeculativeDecoder(target, drafter, tree_shape=TreeSpec.merged((4, 16, 16, 16, 16), (1,) * 8),
        ...                          budget=AdaptiveBudget())

    Every part must offer ``observe`` (all built-in drafters do): a round whose tree leaves a part out (an
    adaptive budget's option, or a part shape of ``()``) lets it catch up on the committed tokens instead.
    """

    def __init__(self, *drafters: Drafter) -> None:
        if len(drafters) < 2:
            raise ValueError(f"MergedDrafter needs two or more drafters, got {len(drafters)}")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafter {i} must implement the Drafter protocol, got {type(d).__name__}")
            if not hasattr(d, "observe"):
                raise ValueError(f"drafter {i} ({type(d).__name__}) has no observe(), which a merged tree needs")
        vocab = {v for v in (getattr(d, "vocab_size", None) for d in drafters) if v is not None}
        if len(vocab) > 1:
            raise ValueError(f"the drafters' vocabularies differ: {sorted(vocab)}")
        self.parts = tuple(drafters)
        self.vocab_size = vocab.pop() if vocab else None
        self.reads_all_target_layers = any(getattr(d, "reads_all_target_layers", True) for d in drafters)
        # the merge keeps a per-layout cache, so it runs eagerly (or from the CUDA graph); compiled_calls compiles
        # the parts instead
        self.compilable = False
        self._layouts: dict = {}

    def __getattr__(self, name: str):
        parts = self.__dict__.get("parts", ())
        if name == "graph_state" and parts and all(hasattr(d, "graph_state") for d in parts):
            return lambda: [t for d in parts for t in d.graph_state()]
        raise AttributeError(name)  # no graph_state unless every part can be captured

    def nbytes(self) -> int:
        return sum(d.nbytes() for d in self.parts if hasattr(d, "nbytes"))

    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        for part, spec in zip(self.parts, self._part_specs(tree)):
            part.prefill(state, spec if spec is not None else tree)

    def observe(self, state: DecodeState, tree: TreeSpec) -> None:
        self._observe(state, tree, [part.observe for part in self.parts])

    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        return self._propose(state, tree, [part.propose for part in self.parts], [part.observe for part in self.parts])

    def compiled_calls(self, compile_fn: Callable[[Callable], Callable]
                       ) -> tuple[Callable[..., DraftTree], Callable[..., None]]:
        """``(propose, observe)`` with every ``compilable`` part's ``propose`` and ``observe`` passed through
        ``compile_fn`` (the decoder's ``torch.compile`` with ``compile=True``), each once: the parts' trees and
        catch-ups come from their compiled code, the merge runs as it is. Each tree a part is asked for (an
        adaptive budget's depth cuts) compiles once."""
        compiled = [getattr(part, "compilable", False) for part in self.parts]
        proposes = [compile_fn(part.propose) if c else part.propose for part, c in zip(self.parts, compiled)]
        observes = [compile_fn(part.observe) if c else part.observe for part, c in zip(self.parts, compiled)]
        return (functools.partial(self._propose, proposes=proposes, observes=observes),
                functools.partial(self._observe, observes=observes))

    def _observe(self, state: DecodeState, tree: TreeSpec, observes: Sequence[Callable]) -> None:
        for observe, spec in zip(observes, self._part_specs(tree)):
            observe(state, spec if spec is not None else tree)

    def _propose(self, state: DecodeState, tree: TreeSpec, proposes: Sequence[Callable],
                 observes: Sequence[Callable]) -> DraftTree:
        trees = []
        for propose, observe, spec in zip(proposes, observes, self._part_specs(tree)):
            if spec is None:
                observe(state, tree)
                trees.append(None)
            else:
                trees.append(complete_tree(propose(state, spec), spec))
        return merge_trees(state.root, trees, tree, self._layout(tree, state.root.device))

    def _part_specs(self, tree: TreeSpec) -> list[Optional[TreeSpec]]:
        if len(tree.parts) != len(self.parts):
            raise ValueError(f"tree_shape must be TreeSpec.merged(...) with one shape per drafter "
                             f"({len(self.parts)}), got {tree}")
        return tree.part_specs()

    def _layout(self, tree: TreeSpec, device: torch.device) -> list[Tensor]:
        """Each part's node indices in the merged layout (device tensors, made once per tree and device: outside
        any graph capture, whose warm-up calls come first)."""
        key = (tree, device)
        if key not in self._layouts:
            self._layouts[key] = [torch.tensor(n, dtype=torch.int64, device=device) for n in tree.part_nodes()]
        return self._layouts[key]


def merge_trees(root: Tensor, trees: Sequence[Optional[DraftTree]], spec: TreeSpec,
                layout: Optional[Sequence[Tensor]] = None) -> DraftTree:
    """Merge the parts' complete trees (None: a part that sits out) into ``spec``'s layout (see the module).

    Args:
        root: int64 ``[B]`` the shared root.
        trees: one per part of ``spec``, in its own level order.
        layout: each part's merged node indices (``spec.part_nodes()`` as int64 tensors on root's device).

    Returns:
        a complete tree of ``spec.num_nodes`` nodes (tokens, parents, mask, depths, scores, sources). When one part
        alone is drafted its tree is returned as it is (:func:`_one_part`): a few launches instead of dozens.
    """
    drafted = [i for i, t in enumerate(trees) if t is not None]
    if len(drafted) == 1 and spec.parts[drafted[0]] == spec.shape:
        return _one_part(trees[drafted[0]], spec, drafted[0])
    return _merge_all(root, trees, spec, layout)


def _merge_all(root: Tensor, trees: Sequence[Optional[DraftTree]], spec: TreeSpec,
               layout: Optional[Sequence[Tensor]]) -> DraftTree:
    """The general path of :func:`merge_trees`: lay every part out, then deduplicate (:func:`_dedup`)."""
    B, T, dev = root.shape[0], spec.num_nodes, root.device
    if layout is None:
        layout = [torch.tensor(n, dtype=torch.int64, device=dev) for n in spec.part_nodes()]
    tokens = root[:, None].expand(B, T).clone()
    parents = torch.zeros(B, T, dtype=torch.int64, device=dev)
    scores = torch.full((B, T), float("-inf"), device=dev)
    sources = torch.zeros(B, T, dtype=torch.int64, device=dev)
    mask = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
    parents[:, 0], scores[:, 0] = -1, 0.0
    for i, (tree, idx) in enumerate(zip(trees, layout)):
        if tree is None:
            continue
        inner = idx[1:]
        # every value a device tensor: index_put_ with a Python number copies it from the host, which a CUDA graph
        # capture refuses
        tokens[:, inner] = tree.tokens[:, 1:]
        parents[:, inner] = idx[tree.parents[:, 1:]]
        scores[:, inner] = (tree.scores[:, 1:].to(scores.dtype) if tree.scores is not None
                            else torch.zeros_like(scores[:, inner]))
        sources[:, inner] = torch.full_like(sources[:, inner], 1 << i)
        mask[:, idx[:, None], idx[None, :]] = tree.mask  # the parts share the root; nothing else
    depths = spec.depth_tensor(dev)
    parents, mask, scores, sources = _dedup(tokens, parents, mask, depths, spec.depth, scores, sources, len(trees))
    return DraftTree(tokens, parents, mask, depths.expand(B, T), scores, sources)


def _one_part(tree: DraftTree, spec: TreeSpec, part: int) -> DraftTree:
    """The merged tree when one part alone is drafted (the others are empty in ``spec``): that part's layout is the
    merged one, so its tree is taken as it is, with sources ``1 << part`` (the root none) and the merged depths.

    The general path would also deduplicate the part's own siblings; a part's tree is verified here as that drafter
    alone would have it verified (the built-in drafters propose distinct siblings, except prompt lookup's fillers,
    which score -inf either way), and the result equals the general path's whenever its siblings are distinct. It
    relies on the protocol's root (token ``root``, parent -1, score 0)."""
    B, T = tree.tokens.shape
    dev = tree.tokens.device
    scores = tree.scores.to(torch.float32) if tree.scores is not None else torch.zeros(B, T, device=dev)
    sources = torch.full_like(tree.tokens, 1 << part)
    sources[:, 0] = 0
    mask = tree.mask if tree.mask is not None else tree_mask_from_parents(tree.parents, spec)
    return DraftTree(tree.tokens, tree.parents, mask, spec.depth_tensor(dev).expand(B, T), scores, sources)


def _dedup(tokens: Tensor, parents: Tensor, mask: Tensor, depths: Tensor, max_depth: int, scores: Tensor,
           sources: Tensor, parts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Deduplicate a laid-out tree by path: a node whose token path from the root an earlier node has is a
    duplicate; its children move to that node (its *twin*, the first node with the path), which takes its sources;
    its score becomes -inf. All levels at once, from each node's path (the tokens of its ancestors by depth, read
    off the ancestor mask), so the cost does not grow with the depth.

    Args: tokens / parents / scores / sources ``[B, T]`` and the ancestor-or-self mask ``[B, T, T]`` of the laid-out
    tree, depths int64 ``[T]`` (at most ``max_depth``). Returns the deduplicated ``(parents, mask, scores,
    sources)``."""
    B, T = tokens.shape
    dev = tokens.device
    node = torch.arange(T, device=dev)
    at_depth = depths[None, :] == torch.arange(max_depth + 1, device=dev)[:, None]  # [D + 1, T]
    # path[b, i, d]: the token of i's depth-d ancestor (0 past i's depth, where equal depths agree anyway)
    path = (torch.where(mask, tokens[:, None, :], 0)[:, :, None, :] * at_depth).sum(dim=-1)  # [B, T, D+1]
    same = (path[:, :, None, :] == path[:, None, :, :]).all(dim=-1)  # [B, k, j]
    same &= (depths[:, None] == depths[None, :]) & (node[None, :] <= node[:, None])
    first = same.to(torch.int8).argmax(dim=-1)  # [B, T]: k's twin (k itself if none is earlier)
    parents = torch.where(parents >= 0, first.gather(1, parents.clamp(min=0)), parents)
    twin = first[:, :, None] == node  # [B, k, j]: j is k's twin
    merged = torch.zeros_like(sources)
    for i in range(parts):
        has = ((sources >> i) & 1) == 1
        merged |= (twin & has[:, :, None]).any(dim=1).long() << i
    dup = first != node
    # k's ancestors after the move: itself, then its strict ancestors' twins
    eye = node[:, None] == node[None, :]
    mask = torch.bmm((mask & ~eye).float(), twin.float()) > 0.5
    return parents, mask | eye, torch.where(dup, float("-inf"), scores), merged


__all__ = ["MergedDrafter", "merge_trees"]
