"""Outliers and what they cost: per model of the zoo, the per-layer outlier ratio (max over
channels of max|x| ÷ their median) of the keys and of the activations q/k/v read, key kurtosis,
and the perplexity ratio against fp32 of the methods that exist because of outliers: RTN int4
vs AWQ int4 (salient activation channels), naive per-token int2 KV vs KIVI-2 (key outlier
channels), and TurboQuant 2.5.

Real LLMs show ratios of 10–100 (LLM.int8(), SmoothQuant, KIVI, KVQuant); the tiny target shows
about 2, so AWQ and KIVI buy nothing on it. pydoc-outlier (engines/zoo/outliers.py) is the
same function with outlier channels. Both models are measured in the same run, on the same
held-out documents; AWQ calibrates on the documents after them. One JSON line per model.

    .venv/bin/python benchmarks/tiny_model_outliers.py [--docs 16] [--models pydoc-target pydoc-outlier]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from _common import heldout

METHODS = {"rtn-int4": {"weights": "rtn-int4"}, "awq-int4": {"weights": "awq-int4"},
           "kv-int2": {"kv_cache": "int2"}, "kivi-2": {"kv_cache": "kivi-2"}, "turbo-2.5": {"kv_cache": "turbo-2.5"}}


def ratio(x: torch.Tensor) -> float:
    ch = x.reshape(-1, x.shape[-1]).abs().amax(0)
    return round((ch.max() / ch.median()).item(), 2)


def outlier_stats(path: str, text: str) -> list[dict]:
    from engines.reference.cache import NoCache
    from engines.reference.model import load_model
    from transformers import AutoTokenizer

    model, tok = load_model(path, torch.float32, "cpu"), AutoTokenizer.from_pretrained(path)
    keys: list[torch.Tensor] = []
    normed: list[torch.Tensor] = []
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: keys.append(o.detach())))
        hooks.append(layer.input_layernorm.register_forward_hook(lambda m, i, o: normed.append(o.detach())))
    ids = [tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"][:255]
    x = torch.tensor([ids])
    slots = torch.arange(x.shape[1])
    with torch.inference_mode():
        model(x, slots[None], slots, NoCache(), torch.ones(len(slots), len(slots), dtype=torch.bool).tril()[None, None])
    for h in hooks:
        h.remove()
    return [{"key_outlier_ratio": ratio(k), "qkv_input_outlier_ratio": ratio(a),
             "key_kurtosis": round((((k - k.mean()) ** 4).mean() / k.var() ** 2).item(), 2)}
            for k, a in zip(keys, normed, strict=True)]


def ppl_ratios(path: str, docs: list[str], calibration: list[str]) -> dict:
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    def nll(axes: dict) -> tuple[float, int]:
        options = {"calibration_samples": 16, "calibration_tokens": 256} if axes.get("weights") == "awq-int4" else {}
        spec = OptimizationSpec(engine="reference", **{"weights": "fp32", **axes}, engine_options=options)
        engine = ReferenceEngine(path, spec, calibration)
        results = engine.loglikelihood_rolling([RollingRequest(str(i), t, WindowSpec(256, 256))
                                                for i, t in enumerate(docs)])
        return sum(r.nll for r in results), sum(len(r.token_ids) for r in results)

    base, n_tokens = nll({})
    return {name: round(math.exp((nll(axes)[0] - base) / n_tokens), 4) for name, axes in METHODS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16, help="held-out documents scored (default 16)")
    ap.add_argument("--models", nargs="+", default=["pydoc-target", "pydoc-outlier"], help="builtin models")
    args = ap.parse_args()
    from engines.zoo import resolve_model_path

    torch.manual_seed(0)
    texts = heldout(args.docs + 40)
    docs, calibration = texts[: args.docs], texts[args.docs :]
    for name in args.models:
        path = str(resolve_model_path(f"builtin:{name}"))
        layers = outlier_stats(path, " ".join(heldout(20)))
        print(json.dumps({"benchmark": "tiny_model_outliers", "model": name, "documents": args.docs,
                          "threads": torch.get_num_threads(), "ppl_ratio_vs_fp32": ppl_ratios(path, docs, calibration),
                          "layers": layers}), flush=True)


if __name__ == "__main__":
    main()
