"""End-to-end decoding rounds on one GPU: tau, tokens/s and the per-round time split (draft / verify / other) of
every drafter on a small random Llama target, CUDA graphs on, plus COMMIT vs REFEED for the accepted path's K/V.

The target is random (no weights can be downloaded), so acceptance comes only from prompt lookup and the
self-draft on a repetitive prompt; the LongSpec draft is randomly initialised and measures the draft's cost, not
its acceptance. Usage (GPU): ``python -m benchmarks.bench_decode --context 8192``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from longspec import LongSpecDraft, LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder, StreamingSelfDrafter
from longspec.decode.decoder import KVUpdate
from longspec.testing import first_divergence


def build_target(device="cuda"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=131072,
                      initializer_range=0.2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()


def prompt(context: int, device="cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    block = torch.randint(3, 32000, (257,), generator=g)
    return block.repeat(context // 257 + 1)[:context][None].to(device)


def run(target, ids, drafter, shape, new_tokens, kv_update=KVUpdate.COMMIT) -> dict:
    dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True, kv_update=kv_update)
    dec.generate(ids, 16)  # warm-up: compile kernels, capture graphs
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = dec.generate(ids, new_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = out.stats
    decode_s = wall - s.time_prefill
    return {"tau": s.tau, "rounds": s.rounds, "tokens": s.generated_tokens, "tokens_per_s": s.generated_tokens / decode_s,
            "ms_per_round": 1e3 * decode_s / max(1, s.rounds), "draft_ms": 1e3 * s.time_draft / max(1, s.rounds),
            "verify_ms": 1e3 * s.time_verify / max(1, s.rounds), "other_ms": 1e3 * s.time_other / max(1, s.rounds),
            "prefill_s": s.time_prefill, "sequences": out.sequences}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    target = build_target()
    ids = prompt(a.context)
    methods = {
        "plain (Vanilla FA)": (None, (1,), KVUpdate.COMMIT),
        "PLD chain 6": (PromptLookupDrafter(), (1,) * 6, KVUpdate.COMMIT),
        "PLD tree 4-4-4-4": (PromptLookupDrafter(), (4, 4, 4, 4), KVUpdate.COMMIT),
        "PLD tree 4-4-4-4 REFEED": (PromptLookupDrafter(), (4, 4, 4, 4), KVUpdate.REFEED),
        "streaming self-draft chain 4": (StreamingSelfDrafter(sink=32, window=1024), (1,) * 4, KVUpdate.COMMIT),
        "LongSpec (random draft) 4-16-16-16-16": (LongSpecDrafter(LongSpecDraft.from_target(target)),
                                                  (4, 16, 16, 16, 16), KVUpdate.COMMIT),
    }
    rows, ref = [], None
    ref32 = copy.deepcopy(target).float()  # to tell bf16 near-ties from real differences
    for name, (drafter, shape, kv) in methods.items():
        r = run(target, ids, drafter, shape, a.new_tokens, kv)
        seq = r.pop("sequences")
        ref = seq if ref is None else ref
        r["identical_to_plain"] = bool(torch.equal(seq, ref))
        d = first_divergence(seq, ref, ref32)
        r["first_divergence"] = None if d is None else {"column": d.column, "fp32_top2_margin": d.margin}
        rows.append({"method": name, **r})
        print(f"{name:40s} tau {r['tau']:.2f}  {r['tokens_per_s']:8.1f} tok/s  {r['ms_per_round']:.2f} ms/round "
              f"(draft {r['draft_ms']:.2f}, verify {r['verify_ms']:.2f}, other {r['other_ms']:.2f})  "
              f"same as plain: {r['identical_to_plain']}")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": a.context,
            "new_tokens": a.new_tokens, "target": "random Llama, 8 layers, hidden 1024, 16/4 heads, D 64, bf16"}
    with open(os.path.join(a.out, "decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
