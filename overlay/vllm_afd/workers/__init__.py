"""Role workers: vLLM's `Worker` (CUDA) and `CPUWorker` subclasses chosen by the config hook.

`common.py` holds what both platforms share; `cpu.py` and `cuda.py` import only their own
platform's worker module, so the CPU workers load on a machine without CUDA and back.
"""
