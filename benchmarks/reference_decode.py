"""Reference engine CPU decode vs transformers' `generate` on the same tiny model and prompts:
greedy, batch 1 (one prompt per call on both sides), --new-tokens per prompt, at each prompt
length of --prompt-tokens (default about 50 and about 700 tokens). The two sides alternate over
--repeats rounds; decode tokens/s by wall and by process CPU time (median, min-max), and TTFT
measured the same way on both sides: from the call to the first token, tokenization included
(a one-token generation). Exits 1 when the two do not produce identical tokens. One JSON line.

    .venv/bin/python benchmarks/reference_decode.py --prompt-tokens 50 700 --threads 1
"""

from __future__ import annotations

import json
import sys
import time

from _common import TARGET, alternate, heldout, host, parser, rate, ratio, setup, spread


def make_prompts(tok, n: int, length: int) -> list[str]:
    """n prompts of about `length` tokens: consecutive held-out text cut at `length` tokens."""
    ids = tok("\n\n".join(heldout(400)), add_special_tokens=False)["input_ids"]
    return [tok.decode(ids[i * length:(i + 1) * length]) for i in range(n)]


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--prompts", type=int, default=8, help="prompts per length (default 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[50, 700], help="prompt lengths (default 50 700)")
    args = p.parse_args()
    setup(args)
    import torch
    from engines.protocol import GenerationRequest
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ref = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32"))

    def ours(texts: list[str], new: int) -> list[tuple[int, ...]]:
        return [ref.generate([GenerationRequest(str(i), t, new)])[0].token_ids for i, t in enumerate(texts)]

    @torch.no_grad()
    def theirs(texts: list[str], new: int) -> list[tuple[int, ...]]:
        out = []
        for text in texts:  # the same input as the reference engine: end-of-text, then the prompt
            ids = torch.tensor([[tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                            pad_token_id=tok.eos_token_id)
            out.append(tuple(int(x) for x in g[0, ids.shape[1]:] if int(x) != tok.eos_token_id or new == 1))
        return out

    rows, same = [], True
    for length in args.prompt_tokens:
        texts = make_prompts(tok, args.prompts, length)
        ours(texts[:1], 4), theirs(texts[:1], 4)  # warm-up, both
        decode = alternate({"reference": lambda t=texts: ours(t, args.new_tokens),
                            "transformers": lambda t=texts: theirs(t, args.new_tokens)}, args.repeats)
        first = alternate({"reference": lambda t=texts: ours(t, 1), "transformers": lambda t=texts: theirs(t, 1)}, args.repeats)
        a, b = decode["reference"].result, decode["transformers"].result
        identical = a == b
        same &= identical
        tokens = sum(map(len, a))
        rows.append({
            "prompt_tokens": length, "new_tokens_total": tokens, "identical_tokens": identical,
            "reference_tokens_per_s": rate(tokens, decode["reference"]),
            "transformers_tokens_per_s": rate(sum(map(len, b)), decode["transformers"]),
            "speedup": ratio(decode["reference"], decode["transformers"]),
            # per prompt, from the call to its first token: a round's time over its prompts
            "reference_ttft_ms": spread([w / len(texts) for w in first["reference"].wall], 1000, 2),
            "transformers_ttft_ms": spread([w / len(texts) for w in first["transformers"].wall], 1000, 2),
        })
    print(json.dumps({"benchmark": "reference_decode", "device": "cpu", **host(), "prompts": args.prompts,
                      "new_tokens": args.new_tokens, "repeats": args.repeats, "order": "alternating", "lengths": rows,
                      "at": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    if not same:
        print("the reference engine and transformers generated different tokens: the speeds compare unequal work",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
