"""The only layer that speaks HTTP: the ``ChatModel`` protocol every method and agent calls through, its HTTP client
(routing, retries, streaming, batching over replicas), replay from the run store as a wrapper, the one sampling
resolution, and the embedded local model's server and weights."""
