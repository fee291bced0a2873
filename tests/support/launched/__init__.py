"""Scripts that launchers start by path (``python -m owner_reduce.run launched_train.py``, ``torchrun``, DeepSpeed's
launcher, plain ``python stall_worker.py``), as a user's training scripts are; a test may also import what they
define. Run as a script, each finds its neighbours through its own folder, as ``python train.py`` does."""
