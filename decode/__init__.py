"""What makes a vLLM engine a decode engine: its role in the KV path and its server arguments."""
