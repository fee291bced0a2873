"""In-process ranks on the communicator stand-ins: ``ExchangeWorld``/``MirrorComm`` at the runtime's seam and the fake
torch.distributed under ``TorchDistComm``; the real runtime's bookkeeping where ranks may differ."""
