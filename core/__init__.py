"""The engine skeleton every model shares: requests, scheduling, paged KV cache, prefix cache, sampling,
detokenising and the model runner. It imports the HAL, never a model or a backend."""
