"""Real-size step latency (issue 7): random-initialised targets built from published configurations, one H200.

For each model and context N it times, under CUDA graphs (median of ``--iters`` replays, CUDA events): the plain
decode step (one token, ``prefix_attn``), the verify step (the 69-node 4-16-16-16-16 tree, ``hybrid_tree_attn``),
the LongSpec draft step (``propose`` for the whole tree: 5 levels of the one-layer draft) and the accept step
(per-node draws, tree acceptance and ``commit_kv_`` for every layer, eager as in the engine). It then projects the
speedup of LongSpec over plain decoding at the given tau (tokens per target forward, e.g. the trained pair's
measured tau from ``bench_e2e``): ``tau * decode / (draft + verify + accept)``. No prefill runs: the cache rows are
filled with random values and the committed length is set to N, which is all the step kernels read.

The configurations are the published ones (``CONFIGS``) with ``max_position_embeddings`` raised to 262144 so the
RoPE table covers 128k (as in the long-context variants LongSpec used, e.g. Llama-3-8B-Instruct-262k); weights are
random, which changes no step's cost. Usage (GPU):
``python -m benchmarks.bench_step_latency --models Llama-3-8B Qwen2.5-32B --contexts 8192 32768 131072 --tau 3``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

# Published architecture values (config.json of meta-llama/Meta-Llama-3-8B and Qwen/Qwen2.5-32B).
CONFIGS = {
    "Llama-3-8B": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "Qwen2.5-32B": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False},
}
MAX_POSITIONS = 262144
TREE = (4, 16, 16, 16, 16)


def build(name: str, device: str = "cuda"):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(CONFIGS[name])
    cfg = AutoConfig.for_model(values.pop("model_type"), **values, max_position_embeddings=MAX_POSITIONS)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def time_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in microseconds."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def measure(target, context: int, iters: int) -> dict:
    """Step times in microseconds for one target at committed length ``context`` (batch 1)."""
    from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder
    from longspec.decode.decoder import _CudaGraphDraft
    from longspec.decode.drafter import DecodeState
    from longspec.decode.sampling import SamplingParams
    from longspec.decode.tree import tree_mask_from_parents
    from longspec.decode.verify import accept_tree, node_draws
    from longspec.model.target import use_longspec_attention

    drafter = LongSpecDrafter(LongSpecDraft.from_target(target))
    dec = SpeculativeDecoder(target, drafter, tree_shape=TREE, cuda_graphs=True)
    tree, vocab = dec.tree, target.config.vocab_size
    with torch.inference_mode(), use_longspec_attention(target):
        cache = dec._cache_for(1, context + dec._scratch_rows() + tree.depth + 2)
        cache.kv.normal_()
        cache.seqlens.fill_(context)
        g = torch.Generator(device="cuda").manual_seed(0)
        tokens = torch.randint(0, vocab, (1, context + tree.depth + 2), device="cuda", generator=g)
        root = tokens[:, context].clone()
        state = DecodeState(target, cache, tokens, root, torch.ones(1, dtype=torch.bool, device="cuda"))
        drafter.prefill(state, tree)
        draft = _CudaGraphDraft(drafter, state, tree)
        t_draft = time_us(draft, iters)
        proposal = draft()
        mask = tree_mask_from_parents(proposal.parents, tree)
        verify = dec._graphed("verify", dec._tree_logits)
        t_verify = time_us(lambda: verify(proposal.tokens, mask), iters)
        logits = verify(proposal.tokens, mask).clone()
        decode = dec._graphed("decode", dec._decode_logits)
        t_decode = time_us(lambda: decode(root[:, None]), iters)
        params = SamplingParams(0.0, 0, 1.0, None)

        def accept():
            draws = node_draws(logits, params, cache.seqlens, tree, None)
            acc = accept_tree(proposal.tokens, proposal.parents, mask, draws, tree)
            torch.ops.longspec.commit_kv_(cache.planes(), cache.seqlens, acc.accept_index.to(torch.int32),
                                          acc.accept_len.to(torch.int32))

        t_accept = time_us(accept, iters)
    out = {"context": context, "decode_us": t_decode, "verify_us": t_verify, "draft_us": t_draft,
           "accept_us": t_accept, "round_us": t_draft + t_verify + t_accept,
           "draft_bytes": drafter.nbytes(), "draft_params": sum(p.numel() for p in drafter.draft.parameters())}
    del dec, drafter
    torch.cuda.empty_cache()
    return out


def write(rows: list[dict], meta: dict, taus: list[float], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "step_latency.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    head = " | ".join(f"speedup @ tau {t:g}" for t in taus)
    lines = ["# real-size step latency (random weights, bf16, batch 1, CUDA graphs)", "",
             "; ".join(f"{k}: {v}" for k, v in meta.items()), "",
             f"| model | context | decode us | verify us | draft us | accept us | round us | {head} |",
             "|---|---|---|---|---|---|---|" + "---|" * len(taus)]
    for r in rows:
        speedups = " | ".join(f"{t * r['decode_us'] / r['round_us']:.2f}" for t in taus)
        lines.append(f"| {r['model']} | {r['context']} | {r['decode_us']:.0f} | {r['verify_us']:.0f} | "
                     f"{r['draft_us']:.0f} | {r['accept_us']:.0f} | {r['round_us']:.0f} | {speedups} |")
    with open(os.path.join(out_dir, "step_latency.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--tau", type=float, nargs="+", default=[3.0], help="tau values to project the speedup at")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_latency needs a CUDA device")
    rows = []
    for name in a.models:
        target = build(name)
        for context in a.contexts:
            row = {"model": name, **measure(target, context, a.iters)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del target
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tree": "-".join(map(str, TREE)),
            "git_sha": os.environ.get("LONGSPEC_GIT_SHA", "unknown")}
    write(rows, meta, a.tau, a.out)


if __name__ == "__main__":
    main()
