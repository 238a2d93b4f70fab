"""`canary engine-serve`: the reference engine behind an OpenAI-compatible API, with vLLM's
metric names on /metrics (docs/reference.md §7) — so that the openai engine and the judge client are
tested end to end over real HTTP, and a team can point any OpenAI client at a local config.

Routes (routes.py): GET /v1/models, POST /v1/completions (echo + logprobs for prompt log-probs;
streaming), POST /v1/chat/completions (streaming), POST /tokenize, GET /metrics, GET /health; a
completion's answer, whole or streamed, is answers.py's.
One engine thread owns the engine (engine_thread.py; it is not thread-safe) and decodes
concurrent requests in a continuous batch (engines/reference/batching.py): up to --max-num-seqs
rows, requests joining between decode steps and leaving when done or when their client goes;
--max-queue bounds the requests waiting beyond the batch (a 429 past it); a lossy KV format's
rows each keep their own compressed cache (rows.DecoderRows). Speculative decoding batches
too (each row drafts on its own, one target pass verifies every row's drafts), over a lossy KV
format with a compressed cache per row (rows.SpeculativeRows); with a fault drill, requests decode
one at a time. vllm:num_requests_waiting
counts the queue, vllm:num_requests_running the batch's rows; kv_cache_usage_perc = token
positions the rows hold / max_num_seqs × the model's context (metrics.py).

Input is validated by pydantic request models (schemas.py: CompletionIn, ChatIn, TokenizeIn; they
are in /openapi.json). Bad input — malformed JSON, a wrongly typed or out-of-range field, an
unknown field, a prompt over the context, a token id outside the vocabulary — is a 400 in vLLM's
OpenAI error shape (errors.py), {"error": {"message", "type": "BadRequestError", "param", "code":
400}}; sampling parameters the engine does not implement yet (n > 1, best_of > 1, top_p < 1, stop,
penalties, logit_bias, suffix, logprobs without echo) are a 400 naming the parameter, never
ignored. Chat `logprobs` is accepted (judges ask for it) and answered with `logprobs: null`.

    python -m workers.engine_server --model builtin:pydoc-target --kv-cache turbo-3 --port 8100
"""
