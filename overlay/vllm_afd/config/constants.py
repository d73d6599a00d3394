"""The vocabulary of ``additional_config["afd"]``: its key, the names a user may select, and the refused ones."""

from __future__ import annotations

from vllm_afd.role import Role

AFD_KEY = "afd"
ROLES = tuple(role.value for role in Role)
# NCCL: one GPU per rank, across hosts; IPC: ranks of one node (one GPU or peer GPUs); gloo: CPU, eager.
CONNECTORS = ("P2pNcclAFDConnector", "P2pGlooAFDConnector", "P2pIpcAFDConnector")
# What to use instead, in the messages that refuse a connector name.
CONNECTOR_HINT = ("'P2pNcclAFDConnector' (CUDA, across hosts), 'P2pIpcAFDConnector' (CUDA, one node) or "
                  "'P2pGlooAFDConnector' (CPU, eager)")
# Known names of the Ascend connectors of the reference plugin: rejected with their own message
# (docs/config.md#validation-order, step 7).
CAM_CONNECTORS = ("CAMP2pAFDConnector", "CAMAsyncAFDConnector")

# Input alias (the reference's spelling) -> canonical key. Never both in one config.
ALIASES = {
    "afd_connector": "connector",
    "afd_role": "role",
    "afd_port": "port",
    "afd_host": "host",
    "async": "async_dp",
}

# Names the reference accepted but which are runtime state here; each gets a targeted hint.
RUNTIME_ONLY_FIELDS = {
    # Derived at runtime: a configured role rank double-counted the DP start rank (docs/topology.md#role-rank).
    "afd_role_rank": "role ranks are derived at runtime; remove it",
    "rank": "ranks are derived from vLLM's distributed ranks at runtime; remove it",
    "afd_server_rank": "FFN ranks are derived at runtime; remove it",
    "num_attention_servers": "the attention worker count is 'num_attention_ranks'",
    "num_ffn_servers": "the FFN worker count is 'num_ffn_ranks'",
    "enabled": 'the presence of additional_config["afd"] enables AFD; remove it',
    "afd_extra_config": "connector options go under 'connector_extra_config'",
    "extra_config": "connector options go under 'connector_extra_config'",
}

# Micro-batch stages per step a config may name (docs/pingpong.md).
NUM_STAGES = (1, 2, 3)
# The fewest real tokens per stage before a step splits. NOTE: 4 from the CPU stage benchmark
# (docs/benchmarks.md, "Side by side, settled"): stages of 1-2 tokens ran 0.90-0.96x one stage, 4 and more
# 1.25-1.32x; each stage pays the weight reads and an exchange again.
DEFAULT_MIN_TOKENS_PER_STAGE = 4
