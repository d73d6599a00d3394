"""The attention role: thin runner subclasses over vLLM's own runners.

`mixin.py` holds all AFD logic (connector lifecycle, forward-context sidecar, check
points); `cpu_runner.py` applies it to the V1 CPU runner and `runner.py` to Model Runner
V2 on CUDA, where `capture.py` adds the graph-manager subclass.
"""
