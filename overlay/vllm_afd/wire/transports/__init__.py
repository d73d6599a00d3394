"""Transport backends, one file each; the registry of connector names is vllm_afd/connect.py."""
