"""The AFD wire: everything that crosses between the roles, with no vLLM import.

``placement`` (where a rank sits, its ``Role``), ``topology`` (pairing arithmetic), ``messages``
(control payload), ``steps`` (what a payload sets), ``handshake``, ``rendezvous``, ``store`` and
``refusal`` (start-up), ``watchdog`` (liveness), ``timeline`` (per-exchange marks), ``transport`` (the
backend interface), ``transports/`` (gloo, NCCL, CUDA IPC), ``spec`` (what a connector exchanges),
``connector`` (the link both ends share, over a transport), ``attention_end`` and ``ffn_end`` (each role's
end) and ``ends`` (``make_connector``: the end for a placement). The vLLM-facing layer above it is
``vllm_afd/connect.py``, the runners and the models; tests/wire/test_wire_is_vllm_free.py pins that
nothing here imports vLLM.
"""
