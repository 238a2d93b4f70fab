"""The project's own engine: a small Llama-family decoder (model.py), compressed KV caches
(kv.py), and the engine protocol on top (engine.py)."""
