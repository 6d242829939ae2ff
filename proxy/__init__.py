"""The HTTP API (OpenAI-compatible) and per-request prefill/decode orchestration."""
