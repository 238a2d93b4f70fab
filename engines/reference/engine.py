"""The reference engine behind the engine protocol: batched windows for perplexity, batched
generation at a set concurrency with per-request timings, memory figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from engines.device import resolve_device
from engines.protocol import (
    ChoiceRequest,
    EngineDescription,
    GenerationRequest,
    GenerationResult,
    LayerStates,
    PromptScores,
    RollingRequest,
    RollingResult,
    SpeculativeStats,
)
from engines.reference import scoring
from engines.reference.batching import ContinuousBatch
from engines.reference.cache import KVCache, NoCache
from engines.reference.decode import Decoder
from engines.reference.faults import EngineFault
from engines.reference.kv import kv_format
from engines.reference.layer_states import layer_states as reference_layer_states
from engines.reference.model import Transformer, load_model
from engines.reference.speculative import DraftModelProposer, NgramProposer
from engines.reference.usage import KVUsage, VerifyGraphs
from engines.reference.weights import (
    RTN_BITS,
    Quantized,
    awq,
    calibration_ids,
    checkpoint_quantized,
    rtn,
    use_w4a16_kernels,
)
from engines.spec import OptimizationSpec
from engines.zoo import MOE_AWQ

# streaming hook: (request_id, new token ids, this step's spec-decode counters or None)
OnTokens = Callable[[str, list[int], "SpeculativeStats | None"], None]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# decode loops kept for reuse where their steps are captured as CUDA graphs: one per (batch rows,
# slots bucket, padded or not), the most recently used kept; each holds its KV cache and graph
DECODER_POOL = 2
MIN_BUCKET = 128  # the smallest slots bucket
LINEAR_BUCKET = 4096  # buckets double up to this, then grow by it (a long context wastes at most this many slots)


def slots_bucket(slots: int, context: int) -> int:
    """The pool's cache width for `slots`: a power of two from MIN_BUCKET up to LINEAR_BUCKET, then
    the next multiple of LINEAR_BUCKET; at most the context, never fewer than `slots`."""
    width = (max(MIN_BUCKET, 1 << (slots - 1).bit_length()) if slots <= LINEAR_BUCKET
             else -(-slots // LINEAR_BUCKET) * LINEAR_BUCKET)
    return max(slots, min(context, width))


def compute_dtype_for(weights_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The type the forward pass computes in. fp16/bf16 weights compute in fp32 on a CPU without
    native half-precision matmul (AMX-FP16 for fp16, AVX512-BF16 for bf16), where PyTorch emulates
    it several times slower than fp32; the stored weights and KV values keep their half-precision
    rounding (the weights are cast to the half type first, then up). A GPU computes in the half type."""
    if device.type != "cpu" or weights_dtype == torch.float32:
        return weights_dtype
    native = (torch.cpu._is_amx_fp16_supported() if weights_dtype == torch.float16
              else torch.cpu._is_avx512_bf16_supported())
    return weights_dtype if native else torch.float32




class ReferenceEngine:
    def __init__(self, model_path: str, spec: OptimizationSpec, calibration: Sequence[str] | None = None):
        from transformers import AutoTokenizer

        spec.check_available()
        self.spec = spec
        self.model_path = str(model_path)
        self.device = resolve_device(spec)
        self.batch_size = int(spec.option("batch_size"))
        self.concurrency = int(spec.option("concurrency"))
        self.dtype = DTYPES.get(spec.weights, torch.float16)  # the weights' float type, as stored
        self.compute_dtype = compute_dtype_for(self.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        tok = self.tokenizer
        self.start_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        model = load_model(self.model_path, torch.float32, "cpu")
        # a canary drill (engine_options.fault; engines/reference/faults.py): without one, every hook is the identity
        self.fault = EngineFault(spec.option("fault"), spec.kv_cache, model.args.vocab_size,
                                 lambda ids: cast(str, tok.decode(ids, skip_special_tokens=True)))
        self.fault.corrupt_weights(model)
        # a config's own checkpoint holds weights quantized already (load_model dequantized them): none again
        quantized = (checkpoint_quantized(model, spec.bits_per_weight) if spec.checkpoint
                     else rtn(model, RTN_BITS[spec.weights]) if spec.weights in RTN_BITS
                     else self._awq(model, calibration) if spec.weights == "awq-int4" else Quantized())
        self.packed = quantized.packed  # int4 layers: (q, zero, scale) for the W4A16 kernels
        self.quantized_params, self.quantized_bytes = quantized.params, quantized.bytes
        self.kv = self.fault.corrupt_kv(kv_format(spec.kv_cache, self.compute_dtype, self.dtype), model.args.n_layers,
                                       model.args.max_seq_len)
        self.kv.calibrate(model)  # per-layer choices from the weights (fractional TurboQuant), else nothing
        self.model: Transformer = model.to(device=self.device, dtype=self.dtype).to(self.compute_dtype).fuse()
        self.args = model.args
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.usage = KVUsage(model.args.max_seq_len)  # KV bytes and kv_cache_usage at their peaks (usage.py)
        self.decode_graphs = "not run yet"  # whether decode steps replayed a CUDA graph, or why not
        # generation's decode loops are reused per batch bucket where their steps are captured (the
        # capture's warm-up and graph are paid once per bucket, not per batch); elsewhere one per batch
        self.reuse_decoders = self.device.type == "cuda" and spec.option("cuda_graphs") is not False
        self._decoders: dict[tuple[int, int, bool], Decoder] = {}  # least recently used first
        self._refused: set[tuple[int, int, bool]] = set()  # buckets whose step could not be captured
        self._graph_pool = torch.cuda.graph_pool_handle() if self.reuse_decoders else None
        self.decoders_built, self.batches_decoded = 0, 0
        # speculative decoding's verify pass at one width per request, captured where graphs are (speculative_verify.py)
        self.static_verify = self.reuse_decoders
        self.verify = VerifyGraphs()  # how the speculative verify pass ran (speculative_verify.py)
        from engines.kernels import use_triton

        self.int4_note = ""  # which kernel multiplies one row through the int4 layers (describe's notes)
        if self.packed and use_triton(self.device):
            self.int4_note = use_w4a16_kernels(self.model, self.packed, self.device, spec.option("int4_gemv"))
        self.draft_model: Transformer | None = None
        self.proposer = self._proposer(spec)

    def _proposer(self, spec: OptimizationSpec) -> NgramProposer | DraftModelProposer | None:
        sp = spec.speculative
        if sp.method == "off":
            return None
        if self.concurrency != 1:
            raise ValueError("engine_options.concurrency: speculative decoding runs one request at a time; "
                             "use concurrency 1")
        if sp.method == "ngram":
            return NgramProposer(sp.k, sp.prompt_lookup_max, sp.prompt_lookup_min)
        from engines.zoo import check_draft_tokenizer, resolve_model_path

        draft_path = resolve_model_path(sp.draft_model)
        check_draft_tokenizer(self.model_path, str(draft_path))
        self.draft_model = (load_model(draft_path, torch.float32, "cpu").to(device=self.device, dtype=self.dtype)
                            .to(self.compute_dtype).fuse())
        d = self.draft_model.args
        return DraftModelProposer(
            self.draft_model, sp.k,
            lambda slots: KVCache(d.n_layers, 1, slots, d.n_kv_heads, d.head_dim, self.compute_dtype, self.device,
                                  kv_format("auto", self.compute_dtype, self.dtype)),
        )

    def _awq(self, model: Transformer, calibration: Sequence[str] | None) -> Quantized:
        """AWQ on domain calibration text: `calibration_samples` windows of `calibration_tokens`
        (defaults 128 × min(512, context)), cut from the texts joined end to end. The search's outcome
        comes from the on-disk cache when this model and these token ids were calibrated before
        (engines/reference/awq.py; awq_from_cache says whether it did)."""
        if model.args.sparse_layers:
            raise ValueError(MOE_AWQ)
        n = int(self.spec.option("calibration_samples"))
        t = int(self.spec.option("calibration_tokens") or min(512, model.args.max_seq_len))
        ids = calibration_ids(self.tokenizer, self.start_id, calibration, n, t)
        self.calibration_shape = tuple(ids.shape)
        quantized, self.awq_from_cache = awq(model, ids, self.model_path, self.fault.weights_tag)
        return quantized

    def new_cache(self, batch: int, slots: int) -> KVCache:
        a = self.args
        return self.usage.cache(KVCache(a.n_layers, batch, slots, a.n_kv_heads, a.head_dim, self.compute_dtype,
                                        self.device, self.kv))

    def decoder(self, batch: int, slots: int, graphs: bool | None = None) -> Decoder:
        """The static decode loop (engines/reference/decode.py) over a fresh cache; graphs:
        capture its decode step (default: the spec's cuda_graphs option)."""
        d = Decoder(self.model, self.kv, batch, slots, self.device, self.compute_dtype,
                    self.spec.option("cuda_graphs") if graphs is None else graphs)
        self.usage.cache(d.cache)
        return d

    def pooled_decoder(self, batch: int, slots: int, padded: bool) -> Decoder:
        """A decode loop of at least `slots` slots for a batch: with reuse_decoders, the pool's
        for (batch, slots_bucket(slots), padded), made on first use and kept (DECODER_POOL of
        them, the least recently used dropped before another is made); else a fresh one. A loop
        whose step could not be captured (its format or padding blocks it, or the capture failed)
        is not kept: it would save nothing and read a wider cache. A reused loop's cache is
        zeroed first, so nothing of an earlier sequence (a non-finite value included) reaches a
        masked read."""
        self.batches_decoded += 1
        if not self.reuse_decoders:
            self.decoders_built += 1
            return self.decoder(batch, slots)
        key = (batch, slots_bucket(slots, self.args.max_seq_len), padded)
        decoder = self._decoders.pop(key, None)
        if decoder is not None and decoder.capture_refused:  # not kept: one per batch from here on
            self._refused.add(key)
        if key in self._refused:
            self.decoders_built += 1
            return self.decoder(batch, slots)
        if decoder is None:
            while len(self._decoders) >= DECODER_POOL:  # before the new cache is allocated
                del self._decoders[next(iter(self._decoders))]
            self.decoders_built += 1
            decoder = Decoder(self.model, self.kv, batch, key[1], self.device, self.compute_dtype,
                              self.spec.option("cuda_graphs"), graph_pool=self._graph_pool)
            self.usage.cache(decoder.cache)
        else:
            decoder.cache.zero_()
        self._decoders[key] = decoder  # the most recently used last
        return decoder

    @property
    def peak_kv_bytes(self) -> int:
        return self.usage.peak_bytes

    @property
    def verify_graphs(self) -> str:
        return self.verify.reason

    # -- perplexity --------------------------------------------------------------------------------
    @torch.inference_mode()
    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        """Each document's tokens in strided windows, a window per prefill (engines/reference/scoring.py)."""
        jobs, encoded, spans = scoring.windows(self, requests)
        return scoring.results(self, requests, jobs, scoring.prefill_windows(self, jobs), encoded, spans)

    def loglikelihood_choices(self, requests: Sequence[ChoiceRequest]) -> list[tuple[float, ...] | None]:
        """Multiple-choice items, each prompt's tokens computed once for its choices (engines/reference/scoring.py
        `choices`; engines/protocol.py ScoresChoices)."""
        return scoring.choices(self, requests)

    @property
    def scores_decode(self) -> bool:
        """Whether decode-regime scoring can differ from the rolling pass: a lossy KV cache."""
        return self.kv.lossy

    @torch.inference_mode()
    def loglikelihood_decode(self, requests: Sequence[RollingRequest]) -> list[RollingResult]:
        """The rolling pass's windows and scored tokens, teacher-forced one token per decode step
        through the KV cache (engines/reference/scoring.py)."""
        jobs, encoded, spans = scoring.windows(self, requests)
        return scoring.results(self, requests, jobs, scoring.decode_windows(self, jobs), encoded, spans)

    @torch.inference_mode()
    def next_token_logprobs(self, requests: Sequence[RollingRequest]) -> list[tuple[RollingResult, np.ndarray]]:
        """The rolling pass with each scored token's whole next-token distribution: per document,
        its result and a numpy array [T, V] of log-softmax rows, row i the distribution token i was
        drawn from (evals/distribution.py: KLD, Δp, same top p)."""
        return scoring.with_distributions(self, requests)

    def layer_states(self, request: RollingRequest) -> LayerStates:
        """The request's first window layer by layer: hidden states, attention outputs, and the keys
        and values read back from the KV cache (engines/reference/layer_states.py)."""
        return reference_layer_states(self, request)

    @torch.inference_mode()
    def prompt_logprobs(self, ids: Sequence[int], top_k: int = 0) -> PromptScores:
        """One pass over token ids (the caller's BOS included): log p(ids[i] | ids[:i]) for i ≥ 1,
        the `top_k` most likely tokens with their log-probs at each of those positions and after
        the last (the server's echo=True path, OpenAI's top_logprobs), and the greedy next token."""
        if len(ids) > self.args.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's context is {self.args.max_seq_len}")
        x = torch.tensor([list(ids)], device=self.device)
        slots = torch.arange(len(ids), device=self.device)
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool, device=self.device).tril()[None, None]
        cache = self.new_cache(1, len(ids)) if self.kv.lossy else NoCache()
        h = self.model(x, slots[None], slots, cache, mask, hidden=True)
        if isinstance(cache, KVCache):
            self.usage.tokens(len(ids), cache)
        logprobs = torch.log_softmax(self.model.lm_head(h[0]).float(), -1)  # [T, V]: position t predicts t + 1
        picked = logprobs[:-1].gather(-1, x[0, 1:, None]).squeeze(-1)
        top: list[list[tuple[int, float]]] = []
        if top_k:
            values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), -1)
            top = [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)]
        next_logprob, next_token = logprobs[-1].max(-1)
        return PromptScores(self.fault.prompt_logprobs(picked.tolist()), top, int(next_token), float(next_logprob))

    # -- generation --------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest],
                 on_tokens: OnTokens | None = None) -> list[GenerationResult]:
        """The requests through the engine's one decode loop (engines/reference/batching.py), the
        scheduler engine-serve drives: `concurrency` at a time as one wave (left-padded prefill,
        then lockstep decode steps), stepped until the batch is empty, then the next wave; each
        request's TTFT counts from its wave's start. With speculative decoding, one request at a
        time. on_tokens(request_id, new token ids, spec counters delta) is called as tokens are
        produced (the OpenAI-compatible server streams from it)."""
        on_tokens = self.fault.stream(on_tokens)  # a token-corrupt drill streams the ids it emits
        batch = ContinuousBatch(self, 1 if self.proposer is not None else self.concurrency, waves=True)
        out: list[GenerationResult] = []
        with torch.inference_mode():
            for s in range(0, len(requests), len(batch.cache.lengths)):
                wave = list(requests[s : s + len(batch.cache.lengths)])
                # a ttft-delay drill's delay runs once the clock has started
                seqs = ([batch.add(wave[0], self.fault.before_first_token)] if self.proposer is not None
                        else batch.add_wave(wave, self.fault.before_first_token))
                sent = [0] * len(seqs)
                while True:
                    for i, seq in enumerate(seqs):
                        if on_tokens and len(seq.tokens) > sent[i]:
                            on_tokens(seq.request.request_id, seq.tokens[sent[i]:], seq.last_spec)
                        sent[i] = len(seq.tokens)
                    if all(seq.done for seq in seqs):
                        break
                    batch.step()
                for seq in seqs:
                    out.append(batch.result(seq))
                    batch.remove(seq)
        return self.fault.results(out)

    def prompt_token_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt's ids: the start token and the text's tokens, or the ids the request gives."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        return [self.start_id] + self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]

    # -- description -------------------------------------------------------------------------------
    def server_stats(self) -> None:
        """In-process: no serving process reports figures of its own."""
        return None

    def reset_peaks(self) -> None:
        self._decoders.clear()  # a pooled loop's cache would otherwise count in the next run's peaks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.usage.reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def describe(self) -> EngineDescription:
        import transformers

        a = self.args
        params = self.n_params
        elt = torch.finfo(self.dtype).bits // 8
        resident = sum(t.nbytes for t in self.model.state_dict().values())  # tied weights counted once below
        if a.tie_embeddings:
            resident -= self.model.lm_head.weight.nbytes
        computed = "" if self.compute_dtype == self.dtype else (
            f"weights stored as {str(self.dtype).removeprefix('torch.')} values, computed in "
            f"{str(self.compute_dtype).removeprefix('torch.')} (this CPU has no native half-precision matmul)")
        kb, vb = self.kv.bits_per_element(a.head_dim)
        per_token_elems = a.n_layers * a.n_kv_heads * a.head_dim
        return EngineDescription(
            engine="reference",
            model=self.model_path,
            weights=self.spec.weights,
            kv_cache=self.kv.name,
            speculative=self.spec.speculative.method,
            device=str(self.device),
            compute_dtype=str(self.compute_dtype).removeprefix("torch."),
            parameters=params,
            weight_bytes=int((params - self.quantized_params) * elt + self.quantized_bytes),
            kv_bytes_per_token=int(round(per_token_elems * (kb + vb) / 8)),
            versions={"torch": torch.__version__, "transformers": transformers.__version__},
            notes=(f"kv bits/element: keys {kb:.3f}, values {vb:.3f}", f"decode CUDA graphs: {self.decode_graphs}",
                   *([f"decode loops: {self.decoders_built} built for {self.batches_decoded} batches (reused per "
                      f"batch bucket)"] if self.reuse_decoders else []),
                   *([f"speculative verify CUDA graphs: {self.verify_graphs}"] if self.proposer is not None else []),
                   *([computed] if computed else []), *([self.int4_note] if self.int4_note else []),
                   *self.fault.notes),
            resident_weight_bytes=int(resident),
            peak_kv_cache_bytes=int(self.usage.peak_bytes),
            kv_cache_usage=self.usage.peak_usage,
            peak_device_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
        )
