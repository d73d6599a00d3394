"""The AFD wire: everything that crosses between the roles, with no vLLM import.

``placement`` (where a rank sits), ``topology`` (pairing arithmetic), ``messages`` (control
payload), ``steps`` (what a payload sets), ``handshake`` and ``rendezvous`` (start-up),
``watchdog`` (liveness), ``transport`` (the backend interface), ``transports/`` (gloo, NCCL, CUDA IPC) and
``connector`` (the engine over a transport). The vLLM-facing layer above it is
``vllm_afd/connect.py``, the runners and the models; tests/wire/test_wire_is_vllm_free.py pins
that nothing here imports vLLM.
"""
