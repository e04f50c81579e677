"""The engine: requests, scheduling, caches, the model runner and per-step sampling helpers."""
