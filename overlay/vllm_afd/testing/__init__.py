"""Test support for AFD: tiny random-weight MoE checkpoints and a vLLM server harness.

Nothing here is imported by the plugin; tests, benchmarks and the demo import the
submodules directly (`vllm_afd.testing.tiny_models`, `vllm_afd.testing.server`), and
each submodule imports its heavy dependencies (torch, transformers, requests) itself.
"""
