"""What the ranks' fork server imports once, so that each rank starts without importing torch and DeepSpeed.

Why: a rank spawned fresh spends several seconds importing torch and DeepSpeed, and on two cores four ranks
importing at once cost most of a short end-to-end test. ``launch`` starts ranks from a fork server that has
already imported these (CPU machines only: a fork after CUDA was touched is unusable, see ``launch``).

Why TorchDynamo, Inductor and the rest below: ``deepspeed.initialize`` imports them lazily on every run, plain ZeRO
included (its optimizer check imports the Muon optimizer, which calls ``torch.compile`` at import), and DeepCompile
and owner_reduce's runtime import theirs at ``engine.compile()``: measured on the 2-core CI box, 10-14 s per rank
and launch before the first step. Imports only: nothing here starts a thread, a process group or a compile.

Why names of installed modules, not this module imported there: the fork server is a fresh interpreter that imports
each name before it forks, on its own ``sys.path`` (Python 3.11's does not take the parent's), where the harness,
a folder of the checkout that is never installed, may be missing; a name it cannot import it skips silently, which
would only cost each rank these seconds again.
"""

MODULES = (
    "deepspeed",
    "deepspeed.compile.backend",
    "deepspeed.compile.init_z1_and_2",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.runtime.zero.stage_1_and_2",
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed",
    "torch.export._trace",
    "owner_reduce",
    "owner_reduce.runtime.handle",
    "owner_reduce.wiring.compile_pass",
    "owner_reduce.wiring.ops",
)
