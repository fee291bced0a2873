"""The real GPU stack: cupy's NCCL binding and libnccl (they load without a GPU), torch's NCCL backend, and the tools
that check a GPU; what needs one is marked ``cuda`` and skips without it."""
