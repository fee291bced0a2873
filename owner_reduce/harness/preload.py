"""What the ranks' fork server imports once, so that each rank starts without importing torch and DeepSpeed.

Why: a rank spawned fresh spends several seconds importing torch and DeepSpeed, and on two cores four ranks
importing at once cost most of a short end-to-end test. ``launch`` starts ranks from a fork server that has
already imported these (CPU machines only: a fork after CUDA was touched is unusable, see ``launch``).

Why TorchDynamo, Inductor and the rest below: ``deepspeed.initialize`` imports them lazily on every run, plain ZeRO
included (its optimizer check imports the Muon optimizer, which calls ``torch.compile`` at import), and DeepCompile
and owner_reduce's runtime import theirs at ``engine.compile()``: measured on the 2-core CI box, 10-14 s per rank
and launch before the first step. Imports only: nothing here starts a thread, a process group or a compile.
"""

import deepspeed  # noqa: F401
import deepspeed.compile.backend  # noqa: F401
import deepspeed.compile.init_z1_and_2  # noqa: F401
import deepspeed.runtime.engine  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed  # noqa: F401
import torch.export._trace  # noqa: F401

import owner_reduce  # noqa: F401
import owner_reduce.harness.toy_training  # noqa: F401
import owner_reduce.runtime.handle  # noqa: F401
import owner_reduce.wiring.compile_pass  # noqa: F401
import owner_reduce.wiring.ops  # noqa: F401
