"""Test support for AFD: tiny random-weight MoE checkpoints and a vLLM server harness.

A distribution of its own (`tests/harness`, installed by `ci/setup_env.sh`), not part of
the `vllm_afd` product package, and importing nothing from it.  Tests, benchmarks, the
demo and `scripts/device/` import the submodules directly (`afd_harness.tiny_models`,
`afd_harness.server`, `afd_harness.afd`, `afd_harness.netns`: roles on two "hosts"); each
submodule imports its heavy dependencies (torch, transformers, requests) itself.
"""
