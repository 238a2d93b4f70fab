"""Engine backend on Hugging Face transformers: weights fp32 / fp16 / bf16 and round-to-nearest
int8 / int4 (group 128). Quantized weights are dequantized once at load ("fake quantization"):
the model computes with exactly the values an INT-b kernel would use, so quality deltas are real;
the memory figures in describe() are those of the packed format, while speed is fp16 speed.
The project's own engine with real kernels is `reference` (engines/reference, a later release).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import pairwise
from typing import cast

import numpy as np
import torch

from engines.device import EngineLoadError, resolve_device
from engines.protocol import (
    EngineDescription,
    GenerationRequest,
    GenerationResult,
    RollingRequest,
    RollingResult,
    count_words,
    strided_windows,
    token_texts,
    tokenize_with_spans,
)
from engines.quant import fake_quantize, quantized_bytes
from engines.sampling import adjust_logits, sampling_probs
from engines.spec import OptimizationSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_BITS = {"int8": 8, "rtn-int4": 4, "rtn-int3": 3, "rtn-int2": 2}


class TransformersEngine:
    def __init__(self, model_path: str, spec: OptimizationSpec):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the caller shows its own progress
        spec.check_available()
        self.spec = spec
        self.model_path = str(model_path)
        self.device = resolve_device(spec)
        self.batch_size = int(spec.option("batch_size"))
        # Quantized weights compute in fp16 (W8A16 / W4A16), the way their kernels do.
        self.compute_dtype = DTYPES.get(spec.weights, torch.float16)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise EngineLoadError(f"cannot load model from '{self.model_path}': {e}") from e
        self.quantized_bytes = 0
        self.quantized_params = 0
        if spec.weights in QUANT_BITS:
            self._quantize(model, QUANT_BITS[spec.weights])
        self.model = model.to(device=self.device, dtype=self.compute_dtype).eval()  # type: ignore[call-arg]  # transformers' wrapped .to
        bos = self.tokenizer.bos_token_id
        self.start_id = bos if bos is not None else self.tokenizer.eos_token_id

    def _quantize(self, model: torch.nn.Module, bits: int) -> None:
        # Linear layers inside the decoder blocks; embeddings and lm_head stay in 16 bits (as in AWQ).
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
                    mod.weight.copy_(fake_quantize(mod.weight, bits))
                    out_f, in_f = mod.weight.shape
                    self.quantized_bytes += quantized_bytes(out_f, in_f, bits)
                    self.quantized_params += mod.weight.numel()

    # -- loglikelihood ---------------------------------------------------------------------------
    @torch.no_grad()
    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        return self._rolling(requests, None)

    @torch.no_grad()
    def next_token_logprobs(self, requests: Sequence[RollingRequest]) -> list[tuple[RollingResult, np.ndarray]]:
        """The rolling pass with each scored token's whole next-token distribution: per document,
        its result and a numpy array [T, V] of log-softmax rows, row i the distribution token i was
        drawn from (evals/distribution.py), as the reference engine gives them."""
        rows: dict[int, list[torch.Tensor]] = {}
        found = self._rolling(requests, rows)
        vocab = self.model.config.vocab_size
        return [(r, np.concatenate([x.numpy() for x in rows[i]]) if rows.get(i) else np.zeros((0, vocab)))
                for i, r in enumerate(found)]

    def _rolling(self, requests: Sequence[RollingRequest], rows: dict[int, list[torch.Tensor]] | None
                 ) -> list[RollingResult]:
        """The strided windows' log-probs; with `rows`, each document's scored log-softmax rows too,
        window by window (rows[document index])."""
        jobs = []  # (request index, window input ids, n_scored, target ids)
        encoded, spans = [], []
        context = self.model.config.max_position_embeddings
        for i, req in enumerate(requests):
            if req.window.max_length > context:
                raise ValueError(f"perplexity.window: {req.window.max_length} exceeds the model's context of "
                                 f"{context} positions; use a window ≤ {context}")
            ids, offsets = tokenize_with_spans(self.tokenizer, req.text)
            if not ids:
                raise ValueError(f"document '{req.doc_id}' has no tokens")
            spans.append(offsets)
            seq = [self.start_id] + ids
            encoded.append(ids)
            for begin, end, n in strided_windows(len(ids), req.window):
                jobs.append((i, seq[begin:end], n, seq[end - n + 1 : end + 1]))
        logprobs: list[list[float]] = [[] for _ in requests]
        greedy: list[list[int]] = [[] for _ in requests]
        top: list[list[float]] = [[] for _ in requests]  # the argmax's log p
        # Windows are independent; batch those of one length together (no padding needed).
        order = sorted(range(len(jobs)), key=lambda j: (len(jobs[j][1]), j))
        results: dict[int, tuple[list[float], list[int], list[float]]] = {}
        kept: dict[int, torch.Tensor] = {}  # window → its scored rows [n, V], when asked
        for s in range(0, len(order), self.batch_size):
            chunk = [jobs[j] for j in order[s : s + self.batch_size]]
            width = max(len(c[1]) for c in chunk)
            pad = self.start_id
            x = torch.tensor([c[1] + [pad] * (width - len(c[1])) for c in chunk], device=self.device)
            logits = self.model(input_ids=x).logits.float()  # [B, T, V]; right padding is invisible to causal attention
            lsm = torch.log_softmax(logits, dim=-1)
            for row, (j, c) in enumerate(zip(order[s : s + self.batch_size], chunk, strict=True)):
                _, inp, n, tgt = c
                pos = torch.arange(len(inp) - n, len(inp), device=self.device)
                t = torch.tensor(tgt, device=self.device)
                lp = lsm[row, pos].gather(-1, t[:, None]).squeeze(-1)
                best, argmax = lsm[row, pos].max(-1)
                results[j] = (lp.tolist(), argmax.tolist(), best.tolist())
                if rows is not None:
                    kept[j] = lsm[row, pos].cpu()
        for j, (i, *_rest) in enumerate(jobs):  # jobs are in document then window order
            window_lps, window_greedy, window_top = results[j]
            logprobs[i].extend(window_lps)
            greedy[i].extend(window_greedy)
            top[i].extend(window_top)
            if rows is not None:
                rows.setdefault(i, []).append(kept[j])
        return [
            RollingResult(
                doc_id=req.doc_id,
                token_ids=tuple(encoded[i]),
                logprobs=tuple(logprobs[i]),
                greedy_ids=tuple(greedy[i]),
                n_bytes=len(req.text.encode("utf-8")),
                n_words=count_words(req.text),
                char_spans=spans[i],
                greedy_logprobs=tuple(top[i]),
                token_texts=token_texts(self.tokenizer, encoded[i]) if req.texts else (),
                greedy_texts=token_texts(self.tokenizer, greedy[i]) if req.texts else (),
            )
            for i, req in enumerate(requests)
        ]

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_one(self, req: GenerationRequest) -> GenerationResult:
        ids = (list(req.prompt_ids) if req.prompt_ids is not None
               else [self.start_id] + self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"])
        x = torch.tensor([ids], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(req.seed)
        eos = self.tokenizer.eos_token_id
        out_ids: list[int] = []
        stamps: list[float] = []
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        past = None
        for _ in range(req.max_new_tokens):
            out = self.model(input_ids=x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = adjust_logits(out.logits[0, -1].float(), out_ids, req.presence_penalty, req.frequency_penalty,
                                   req.logit_bias)
            if req.temperature > 0:
                probs = sampling_probs(logits, req.temperature, req.top_p, req.top_k)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            else:
                nxt = int(logits.argmax())
            sync()
            stamps.append(time.perf_counter())
            out_ids.append(nxt)
            if nxt == eos:
                break
            x = torch.tensor([[nxt]], device=self.device)
        ttft = (stamps[0] - t0) * 1000
        itl = tuple((b - a) * 1000 for a, b in pairwise(stamps))
        return GenerationResult(
            request_id=req.request_id,
            text=cast(str, self.tokenizer.decode(out_ids, skip_special_tokens=True)),  # one sequence: one str
            token_ids=tuple(out_ids),
            prompt_tokens=len(ids),
            ttft_ms=ttft,
            itl_ms=itl,
            total_ms=(stamps[-1] - t0) * 1000,
            finish_reason="stop" if out_ids[-1] == eos else "length",
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        # Concurrency 1: one request at a time, so TTFT and inter-token times are per-request
        # latencies without queueing. Batched load arrives with the reference engine.
        return [self._generate_one(r) for r in requests]

    # -- description -----------------------------------------------------------------------------
    def server_stats(self) -> None:
        """In-process: no serving process reports figures of its own."""
        return None

    def reset_peaks(self) -> None:
        """Nothing to reset: this engine reports no peaks."""

    def describe(self) -> EngineDescription:
        import transformers

        cfg = self.model.config
        params = sum(p.numel() for p in self.model.parameters())
        elt = torch.finfo(self.compute_dtype).bits // 8
        weight_bytes = (params - self.quantized_params) * elt + self.quantized_bytes
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elt  # keys + values, compute dtype
        notes: tuple[str, ...] = ()
        if self.spec.weights in QUANT_BITS:
            notes = ("weights quantized round-to-nearest and dequantized at load; speed is fp16 speed",)
        return EngineDescription(
            engine="transformers",
            model=self.model_path,
            weights=self.spec.weights,
            kv_cache=(self.spec.kv_cache if self.spec.kv_cache != "auto"
                      else str(self.compute_dtype).removeprefix("torch.")),
            speculative=self.spec.speculative.method,
            device=str(self.device),
            compute_dtype=str(self.compute_dtype).removeprefix("torch."),
            parameters=params,
            weight_bytes=int(weight_bytes),
            kv_bytes_per_token=int(kv_bytes),
            versions={"torch": torch.__version__, "transformers": transformers.__version__},
            notes=notes,
        )


