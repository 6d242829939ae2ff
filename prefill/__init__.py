"""What makes a vLLM engine a prefill engine: its role in the KV path and its server arguments."""
