"""The verifier: greedy tables, and the exact law of the point-mass rule on toy trees (with a power check).

Statistical plan (``reference/verification.md`` section 3A/3C). Each toy case is a tree with one target
distribution per node (vocab 4-16, fan-out 1-8, duplicate siblings, zero-probability children, ties). One outcome is
(deepest accepted node, bonus token), which determines everything the round emits; its exact law is the target's
autoregressive law truncated at the first token that is not a child. N = 200,000 trials run as the batch dimension
through ``node_draws`` + ``accept_tree``, with both noise sources (a seeded torch.Generator and the counter-based
seed-exact Gumbel noise). A G-test (cells with expected count < 5 pooled; any count in a zero-probability cell is
an immediate failure) per case and noise source, Bonferroni over all of them, overall alpha = 1e-3, fixed seeds.

Power: from the noncentral chi-square, with D = sum (p_bad - p)^2 / p >= 4 TV^2, the harness detects with
probability 0.99 every deviation of total variation >= sqrt(lambda / 4N), which at N = 200,000 is 0.0076 for the
smallest case (4 cells) and at most 0.014 for the largest (~200 cells); ``test_harness_power`` recomputes it. The
same harness rejects the biased rules: the p/q ratio on deterministic top-k children (the LongSpec reference's
tree rule, TV ~ 0.3) and a bonus drawn from the original p after sibling rejections (TV = (1 - S) S).
"""
from __future__ import annotations

import math

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

from longspec.decode.drafter import TreeSpec
from longspec.decode.sampling import SamplingParams
from longspec.decode.tree import tree_mask_from_parents
from longspec.decode.verify import accept_tree, node_draws

N_TRIALS = 200_000
CHUNK = 50_000
ALPHA = 1e-3

# name -> (vocab, tree shape, seed)
CASES = {
    "V4-fanout1": (4, (1,), 0),
    "V8-fanout3": (8, (3,), 1),
    "V16-fanout8": (16, (8,), 2),
    "V8-depth2": (8, (2, 4), 3),
    "V6-chain3": (6, (1, 1, 1), 4),
    "V16-depth3": (16, (4, 6, 3), 5),
    "V12-wide-dups": (12, (6, 8), 6),
}
NOISE = ("generator", "seeded")
ALPHA_EACH = ALPHA / (len(CASES) * len(NOISE) + 2)  # + the two power checks


class Toy:
    """A random toy tree: node tokens, parents, one target distribution per node (zeros, ties), the exact law."""

    def __init__(self, vocab: int, shape: tuple[int, ...], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.V, self.spec = vocab, TreeSpec(shape)
        T = self.spec.num_nodes
        parents, tokens = [-1], [0]
        for d in range(1, self.spec.depth + 1):
            lo, hi = self.spec.offsets[d - 1], self.spec.offsets[d]
            for _ in range(shape[d - 1]):
                parents.append(lo + int(torch.randint(hi - lo, (1,), generator=g)))
                tokens.append(int(torch.randint(min(vocab, 3 + shape[d - 1] // 2), (1,), generator=g)))  # dups
        self.parents, self.tokens = torch.tensor(parents), torch.tensor(tokens)
        conc = torch.rand(T, vocab, generator=g) ** 3  # heavy tail; then zeros and ties
        conc[torch.rand(T, vocab, generator=g) < 0.2] = 0.0
        conc[:, 0] = torch.where(conc[:, 0] == 0, conc[:, 1] + 0.1, conc[:, 0])  # keep each row non-empty
        conc[:, 2] = conc[:, 1]  # a tie
        self.p = conc / conc.sum(dim=1, keepdim=True)  # [T, V] float32
        self.law = self._exact_law()

    def children(self, u: int) -> dict[int, int]:
        """token -> first child of u carrying it (later duplicates are never taken)."""
        out: dict[int, int] = {}
        for c in range(1, len(self.tokens)):
            if int(self.parents[c]) == u:
                out.setdefault(int(self.tokens[c]), c)
        return out

    def _exact_law(self) -> torch.Tensor:
        """float64 [T * V]: P(deepest node = u, bonus = y)."""
        T, V = self.p.shape
        p = self.p.double()
        reach = torch.zeros(T, dtype=torch.float64)
        reach[0] = 1.0
        law = torch.zeros(T, V, dtype=torch.float64)
        for u in range(T):  # level order: parents come first
            kids = self.children(u)
            for y in range(V):
                if y in kids:
                    reach[kids[y]] += reach[u] * p[u, y]
                else:
                    law[u, y] = reach[u] * p[u, y]
        return law.reshape(-1)


def engine_outcomes(toy: Toy, noise: str, n: int, seed: int, bonus_from_original_p: bool = False) -> torch.Tensor:
    """Run the engine's verifier on n trials; int64 [n] cells (deepest * V + bonus)."""
    spec, V = toy.spec, toy.V
    logits = toy.p.log()[None].expand(n, -1, -1)  # log p: processing at T = 1 gives back p
    tokens = toy.tokens[None].expand(n, -1)
    parents = toy.parents[None].expand(n, -1)
    mask = tree_mask_from_parents(parents, spec)
    if noise == "seeded":
        params, gen = SamplingParams(temperature=1.0, seed=seed), None
    else:
        params, gen = SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed)
    seqlens = torch.full((n,), 1000 * (seed % 997), dtype=torch.int32)  # distinct positions per chunk
    draws = node_draws(logits, params, seqlens, spec, gen)
    acc = accept_tree(tokens, parents, mask, draws, spec)
    last = (acc.accept_len - 1)[:, None]
    deepest = acc.accept_index.gather(1, last)[:, 0]
    bonus = acc.emitted.gather(1, last)[:, 0]
    if bonus_from_original_p:  # the bug: a fresh draw from p at the deepest node, ignoring the rejected children
        bonus = torch.multinomial(toy.p[deepest], 1, generator=torch.Generator().manual_seed(seed + 1))[:, 0]
    return deepest * V + bonus


def counts_of(sampler, toy: Toy, base_seed: int) -> torch.Tensor:
    total = torch.zeros(toy.law.numel(), dtype=torch.int64)
    for i in range(N_TRIALS // CHUNK):
        total += torch.bincount(sampler(CHUNK, base_seed + i), minlength=toy.law.numel())
    return total


def g_test_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """G-test of counts against the law: cells with E < 5 pooled; a count in a zero-probability cell gives 0."""
    n = int(counts.sum())
    expected = law * n
    if int(counts[law == 0].sum()) > 0:
        return 0.0
    keep = expected >= 5
    obs = torch.cat([counts[keep].double(), counts[~keep & (law > 0)].double().sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep & (law > 0)].sum()[None]])
    nonempty = exp > 0
    obs, exp = obs[nonempty], exp[nonempty]
    g = 2.0 * float(torch.where(obs > 0, obs * torch.log(obs / exp), torch.zeros_like(obs)).sum())
    return float(chi2.sf(g, max(len(exp) - 1, 1)))


def min_detectable_tv(cells: int, n: int, alpha: float, power: float = 0.99) -> float:
    crit = chi2.isf(alpha, cells - 1)
    lam = brentq(lambda l: ncx2.sf(crit, cells - 1, l) - power, 1e-6, 1e6)
    return math.sqrt(lam / (4 * n))


@pytest.mark.parametrize("noise", NOISE)
@pytest.mark.parametrize("case", list(CASES))
def test_point_mass_rule_has_the_exact_law(case, noise):
    toy = Toy(*CASES[case])
    counts = counts_of(lambda n, s: engine_outcomes(toy, noise, n, s), toy, base_seed=100 * CASES[case][2])
    assert counts.sum() == N_TRIALS
    p = g_test_pvalue(counts, toy.law)
    assert p > ALPHA_EACH, f"G-test p = {p:.3g} <= {ALPHA_EACH:.3g}"
    # acceptance at the root equals the mass of its (first) children's tokens
    root_accept = 1.0 - float(toy.law.reshape(len(toy.tokens), toy.V)[0].sum())
    s = sum(float(toy.p[0, t]) for t in toy.children(0))
    assert abs(root_accept - s) < 1e-6


def test_toy_cases_cover_duplicates_and_zero_probability_children():
    """The law tests above are only meaningful if the toys hold the edge cases: check that they do."""
    with_dups = with_zero = 0
    for case in CASES.values():
        toy = Toy(*case)
        kids = [(int(toy.parents[i]), int(toy.tokens[i])) for i in range(1, len(toy.tokens))]
        with_dups += len(kids) > len(set(kids))
        with_zero += any(float(toy.p[u, t]) == 0.0 for u, t in kids)
    assert with_dups >= 3 and with_zero >= 3


def pq_rule_outcomes(toy: Toy, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The biased SpecInfer-style rule on deterministic children: accept x w.p. min(1, p_res(x)/q(x)), else
    p_res = norm(max(p_res - q, 0)); bonus from the accepted child's p, or from p_res if none was accepted.
    Depth-1 trees only."""
    g = torch.Generator().manual_seed(seed)
    p_res = toy.p[0].expand(n, -1).clone()
    taken = torch.zeros(n, dtype=torch.int64)  # 0 = no child accepted
    for c in range(1, len(toy.tokens)):
        x = int(toy.tokens[c])
        open_ = taken == 0
        accept = open_ & (torch.rand(n, generator=g) < (p_res[:, x] / q[x]).clamp(max=1.0))
        taken = torch.where(accept, c, taken)
        reject = open_ & ~accept
        residual = (p_res - q).clamp(min=0)
        residual = residual / residual.sum(dim=1, keepdim=True).clamp(min=1e-30)
        p_res = torch.where(reject[:, None], residual, p_res)
    bonus_dist = torch.where((taken > 0)[:, None], toy.p[taken], p_res)
    bonus = torch.multinomial(bonus_dist, 1, generator=g)[:, 0]
    return taken * toy.V + bonus


def test_harness_power():
    """The harness rejects the two biased verifiers at the same N and alpha (and its detectable TV is small)."""
    worst = max(min_detectable_tv(int((Toy(*c).law > 0).sum()), N_TRIALS, ALPHA_EACH) for c in CASES.values())
    assert worst < 0.015
    toy = Toy(8, (3,), 11)
    q = torch.rand(8, generator=torch.Generator().manual_seed(12)) + 0.05
    q = q / q.sum()
    toy.tokens[1:] = torch.topk(q, 3).indices  # deterministic top-3 of q, as a beam drafter would pick
    toy.law = toy._exact_law()
    biased = counts_of(lambda n, s: pq_rule_outcomes(toy, q, n, s), toy, base_seed=7)
    assert g_test_pvalue(biased, toy.law) < ALPHA_EACH
    toy = Toy(*CASES["V8-depth2"])
    stale = counts_of(lambda n, s: engine_outcomes(toy, "generator", n, s, bonus_from_original_p=True), toy, 9)
    assert g_test_pvalue(stale, toy.law) < ALPHA_EACH


# -- greedy tables ----------------------------------------------------------------------------------------------------


def run_greedy(tokens, parents, shape, argmax):
    """Verify one row whose per-node target argmax is ``argmax`` (greedy draws)."""
    spec = TreeSpec(shape)
    tokens, parents, draws = (torch.tensor([x]) for x in (tokens, parents, argmax))
    acc = accept_tree(tokens, parents, tree_mask_from_parents(parents, spec), draws, spec)
    n = int(acc.accept_len[0])
    return acc.accept_index[0, :n].tolist(), acc.emitted[0, :n].tolist()


def test_greedy_chain_full_partial_and_none():
    chain = [9, 4, 5, 6]
    assert run_greedy(chain, [-1, 0, 1, 2], (1, 1, 1), [4, 5, 6, 7]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert run_greedy(chain, [-1, 0, 1, 2], (1, 1, 1), [4, 8, 6, 7]) == ([0, 1], [4, 8])
    assert run_greedy(chain, [-1, 0, 1, 2], (1, 1, 1), [3, 5, 6, 7]) == ([0], [3])


def test_greedy_tree_takes_the_matching_branch_and_first_duplicate():
    # root 0 -> children 1 (tok 4), 2 (tok 5), 3 (tok 5, duplicate of 2); depth 2: 4 under 2, 5 under 3
    tokens, parents, shape = [9, 4, 5, 5, 7, 8], [-1, 0, 0, 0, 2, 3], (3, 2)
    # argmax at root is 5: node 2 (first with 5) is taken, never its duplicate 3, even though 3's child matches
    assert run_greedy(tokens, parents, shape, [5, 0, 7, 8, 1, 2]) == ([0, 2, 4], [5, 7, 1])
    assert run_greedy(tokens, parents, shape, [5, 0, 6, 8, 1, 2]) == ([0, 2], [5, 6])
    assert run_greedy(tokens, parents, shape, [4, 3, 7, 8, 1, 2]) == ([0, 1], [4, 3])


def test_node_draws_use_the_plain_sampler_positions():
    """A node at depth d draws with the noise key of position seqlens + d + 1 (where its token would land)."""
    from longspec.decode.sampling import sample_tokens

    spec = TreeSpec((2, 2))
    logits = torch.randn(3, spec.num_nodes, 50, generator=torch.Generator().manual_seed(0))
    seqlens = torch.tensor([5, 17, 40], dtype=torch.int32)
    params = SamplingParams(temperature=0.8, top_k=10, seed=99)
    draws = node_draws(logits, params, seqlens, spec)
    depth = spec.depth_tensor("cpu")
    plain = sample_tokens(logits, params, seqlens.long()[:, None] + depth[None] + 1)
    assert torch.equal(draws, plain)
    greedy = node_draws(logits, SamplingParams(), seqlens, spec)
    assert torch.equal(greedy, logits.argmax(-1))
