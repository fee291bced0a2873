"""The simulated device (``tests.support.sim``): the product's cupy path on CUDA's asynchrony and NCCL's blocking and
aborts, and the simulator's own tests against the real stack it stands for."""
