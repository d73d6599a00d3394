"""The AFD planner: should this model run AFD on N GPUs, and with which A:F (docs/planner.md).

`profile` (the PROFILE.json schema), `links` (wire models), `cost` (per-layer costs and the decode step of
each deployment, stages through stage_model.simulate_layers), `search` (every deployment at its best batch
under a TPOT bound), `launch` (the recommendation's `vllm serve` commands, every rank on a host and a GPU),
`timeline` (a profile from recorded timeline files), `measure` and `measure_wire` (a
profile measured through the model's AFD halves and the device's connector).  The CLI is scripts/afd_plan.py.
"""
