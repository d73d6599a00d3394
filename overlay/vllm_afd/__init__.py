"""Attention-FFN Disaggregation (AFD) for vLLM 0.30.0, as an overlay on a patched vLLM.

Importing this package has no side effects and needs neither torch nor vLLM: vLLM's
general-plugin loader imports it in every process (front end, engine core, workers,
the model-inspection subprocess), so anything heavy is imported lazily by the module
that needs it.
"""

__version__ = "0.1.0"
