"""The inference engine: continuous batching over a paged KV cache, on the training layers.

Requests (`requests`: `SamplingParams`, `GenerationRequest`, `RequestOutput`) join and
leave a running batch between decode steps; the scheduler chooses each step's chunks
and owns the KV block allocator; one compiled model call per step runs the same layers
and kernels as training, on the caller's parameters. Only `cli/` and `serving/` import
this package from above; it imports layers, kernels and placement from below.
"""
