"""The FFN role: a connector-driven daemon inside an otherwise native vLLM engine.

`worker.py` (worker overrides: empty KV spec, no warm-up, refusals, loop lifecycle),
`runner.py` (`AFDFFNModelRunner`: model, connector, per-step compute, CUDA graphs),
`loop.py` (the daemon loop: one iteration per attention step, driven by payloads).
"""
