"""What the tests share and never test themselves: one stand-in per layer of the communicator stack (``fakes``: the
runtime's communicator seam; ``tdist``: torch.distributed under ``TorchDistComm``; ``sim``: CUDA and cupy's NCCL under
``CupyNcclComm``), DeepSpeed's log captured (``ds_log``), small ZeRO engines (``zero1_engines``) and the scripts that
launchers start by path (``launched``)."""
