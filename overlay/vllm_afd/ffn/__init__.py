"""The FFN role: a connector-driven loop inside an otherwise native vLLM engine.

`worker.py` (worker overrides: empty KV spec, no warm-up, refusals, loop lifecycle),
`runner.py` (`AFDFFNModelRunner`: model, connector, per-step compute, CUDA graphs),
`loop.py` (the FFN loop: one iteration per attention step, driven by payloads),
`graphs.py` (the FFN's CUDA graphs, keyed by the step's row counts).
"""
