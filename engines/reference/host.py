"""What the decode loop (batching.py), its row stores (rows.py) and the speculative verify pass
(speculative_verify.py) take from the engine that drives them: its model and KV format, the
caches and decode loops it makes, and the figures it keeps (KVUsage, VerifyGraphs). The reference
engine is one; none of those modules imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engines.protocol import GenerationRequest
    from engines.reference.cache import KVCache
    from engines.reference.decode import Decoder
    from engines.reference.kv import KVFormat
    from engines.reference.model import ModelArgs, Transformer
    from engines.reference.speculative import DraftModelProposer, NgramProposer
    from engines.reference.usage import KVUsage, VerifyGraphs
    from engines.spec import OptimizationSpec


class DecodeHost(Protocol):
    spec: OptimizationSpec
    model: Transformer
    args: ModelArgs
    kv: KVFormat
    device: torch.device
    compute_dtype: torch.dtype
    tokenizer: Any
    start_id: int
    proposer: NgramProposer | DraftModelProposer | None
    usage: KVUsage  # KV bytes and kv_cache_usage at their peaks
    verify: VerifyGraphs  # how the speculative verify pass ran
    static_verify: bool  # verify passes at one width, captured as CUDA graphs
    decode_graphs: str  # whether decode steps replayed a CUDA graph, or why not

    def prompt_token_ids(self, req: GenerationRequest) -> list[int]: ...

    def new_cache(self, batch: int, slots: int) -> KVCache: ...

    def decoder(self, batch: int, slots: int, graphs: bool | None = None) -> Decoder: ...

    def pooled_decoder(self, batch: int, slots: int, padded: bool) -> Decoder: ...
