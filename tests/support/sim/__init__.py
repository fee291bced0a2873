"""The simulated device: CUDA streams, events and the ``Sim`` (``cuda``), cupy's NCCL (``nccl``), ranks in processes
(``transport``), the product's runtime driven on it (``runtime``) and the happens-before checker (``hb_cuda``).
``docs/notes/issue-37-simulated-device.md`` says where it departs from the real stack."""
