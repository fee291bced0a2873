"""The runtime that stands where DeepCompile's native extension stands, for ZeRO stages 1 and 2: the handle,
its buckets, the CUDA stream discipline and the communicators (the seam ``comm``, one module per backend:
``torch_comm`` and ``nccl_comm``, whose binding ``nccl_binding`` is the only module that imports cupy).
"""
