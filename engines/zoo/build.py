"""Build the tiny model zoo: a byte-level BPE tokenizer, a Llama-architecture target model
(~5.6 M parameters, grouped-query attention) and a smaller draft model sharing the tokenizer,
trained on the "Python documentation" corpus (engines/zoo/corpus.py).

    python -m engines.zoo.build --out engines/zoo/artifacts      # ~11 min on 2 CPU cores

Deterministic: fixed seeds, fixed data order, deterministic torch algorithms, one thread count.
The held-out split is written beside the models and never reaches training.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Arch:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads: grouped-query attention
    steps: int


TARGET = Arch("pydoc-target", 256, 768, 6, 8, 2, steps=550)
DRAFT = Arch("pydoc-draft", 128, 384, 2, 4, 2, steps=500)
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH = 16
MAX_POSITIONS = 1024


def train_tokenizer(texts: list[str], out: pathlib.Path) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None)
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)
    return fast


def _token_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    import torch

    eos = cast(int, tokenizer.convert_tokens_to_ids(EOS))  # one token's id (the signature also takes a list)
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.append(eos)  # every document starts after an end-of-text marker, as at scoring time
        ids.extend(enc)
    return torch.tensor(ids, dtype=torch.long)


def train_model(arch: Arch, stream: torch.Tensor, eos_id: int, out: pathlib.Path, steps: int | None = None,
                log: Callable[[str], None] = print) -> tuple[LlamaForCausalLM, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,  # type: ignore[call-arg]  # taken through **kwargs (transformers 5 stubs omit it)
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    model = LlamaForCausalLM(cfg)
    steps = steps or arch.steps
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(1234)
    model.train()
    t0 = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log(f"{arch.name} step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out, safe_serialization=True)
    return model, time.time() - t0


def heldout_perplexity(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, texts: list[str],
                       window: int = SEQ_LEN) -> float:
    """Token perplexity over disjoint windows; each document is scored after an end-of-text token."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS)
    nll, n = 0.0, 0
    with torch.no_grad():
        for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids = [eos] + enc
            for start in range(0, len(ids) - 1, window):
                chunk = torch.tensor([ids[start : start + window + 1]])
                logits = model(input_ids=chunk[:, :-1]).logits.float()
                lp = torch.log_softmax(logits, -1).gather(-1, chunk[:, 1:, None])
                nll -= lp.sum().item()
                n += chunk.shape[1] - 1
    return math.exp(nll / n)


def build(out: pathlib.Path, steps: int | None = None, max_docs: int | None = None,
          log: Callable[[str], None] = print) -> dict:
    import tokenizers
    import torch
    import transformers

    from engines.zoo.corpus import collect_documents, split, write_jsonl

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = split(collect_documents())
    if max_docs:
        train, heldout = train[:max_docs], heldout[: max(2, max_docs // 5)]
    write_jsonl(heldout, out / "pydoc-heldout.jsonl")
    t0 = time.time()
    tokenizer = train_tokenizer([d.text for d in train], out / TARGET.name)
    tokenizer.save_pretrained(out / DRAFT.name)
    eos_id = cast(int, tokenizer.convert_tokens_to_ids(EOS))  # one token's id (the signature also takes a list)
    stream = _token_stream(tokenizer, [d.text for d in train])
    log(f"tokenizer: {VOCAB_SIZE} tokens; train stream {len(stream)} tokens from {len(train)} documents")
    manifest: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "train_documents": len(train),
        "train_tokens": len(stream),
        "heldout_documents": len(heldout),
        "models": {},
    }
    for arch in (TARGET, DRAFT):
        model, secs = train_model(arch, stream, eos_id, out / arch.name, steps=steps, log=log)
        ppl = heldout_perplexity(model, tokenizer, [d.text for d in heldout])
        manifest["models"][arch.name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps": steps or arch.steps,
            "train_seconds": round(secs, 1),
            "heldout_token_perplexity": round(ppl, 3),
        }
        log(f"{arch.name}: held-out token perplexity {ppl:.3f}")
    from engines.zoo.outliers import derive

    derive(out / TARGET.name, out / "pydoc-outlier")  # the same function with outlier channels
    log("pydoc-outlier: derived from pydoc-target (engines/zoo/outliers.py)")
    manifest["build_seconds"] = round(time.time() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "artifacts")
    ap.add_argument("--steps", type=int, default=None, help="override training steps (smoke builds)")
    ap.add_argument("--max-docs", type=int, default=None, help="limit documents (smoke builds)")
    args = ap.parse_args()
    print(json.dumps(build(args.out, args.steps, args.max_docs)))


if __name__ == "__main__":
    main()
