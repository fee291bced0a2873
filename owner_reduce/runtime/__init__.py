"""The runtime that stands where DeepCompile's native extension stands, for ZeRO stages 1 and 2: the handle,
its buckets, the CUDA stream discipline and the communicators (torch.distributed, and cupy NCCL in
``nccl_comm``, the only module that imports cupy).
"""
