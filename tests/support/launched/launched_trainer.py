"""A transformers ``Trainer`` script that knows nothing of owner_reduce (it never imports it), driven by its command
line as ``run_clm.py``-style scripts are (``--deepspeed ds_config.json --torch_compile_backend eager ...``): the
tests start it through ``torchrun -m owner_reduce.run``.

It trains the tiny Llama of ``launched_train.py`` on random tokens with the arguments given, then, in the same
process group, once more as plain ZeRO of the same stage (the config without ``compile``, no torch compile): the
reference. Each rank writes both runs' losses, final parameters, what DeepCompile's handle was and its counters to
``--out``. Between the runs it clears what the first ``TrainingArguments`` left in the process (accelerate's state,
its ``ACCELERATE_DYNAMO_*`` variables), so the reference really runs uncompiled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

if __package__:  # imported by a test (tests.support.launched)
    from .launched_train import SEQ, VOCAB, build_model, handle_report
else:  # run by path: its folder is sys.path[0]
    from launched_train import SEQ, VOCAB, build_model, handle_report


@dataclasses.dataclass
class ScriptArgs:
    out: str = dataclasses.field(metadata={"help": "folder for rank<N>.pt"})
    samples: int = 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def train(args, data: RandomTokens) -> dict:  # noqa: ANN001
    from transformers import Trainer

    trainer = Trainer(model=build_model(), args=args, train_dataset=data)
    trainer.train()
    engine = trainer.model_wrapped
    report = handle_report()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    engine.destroy()
    return {"losses": losses, "params": params, "compiled": engine.is_compiled, **report}


def plain_argv(argv: list[str], plain_config: str) -> list[str]:
    """The same command line for plain ZeRO: ``--deepspeed`` names the config without ``compile``, and the
    ``--torch_compile*`` options are gone."""
    out, it = [], iter(argv)
    for arg in it:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--torch_compile"):
            if "=" not in arg and flag != "--torch_compile":
                next(it)
        elif flag == "--deepspeed":
            out += ["--deepspeed", plain_config]
            if "=" not in arg:
                next(it)
        else:
            out.append(arg)
    return out


def main() -> None:
    from accelerate.state import AcceleratorState
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((TrainingArguments, ScriptArgs))
    argv = sys.argv[1:]
    args, script = parser.parse_args_into_dataclasses(args=argv)
    torch.set_num_threads(1)
    data = RandomTokens(script.samples)
    runs = {"dc": train(args, data)}

    import deepspeed.comm as dist

    os.makedirs(script.out, exist_ok=True)
    with open(args.deepspeed) as f:
        plain = json.load(f)
    plain.pop("compile", None)
    plain_config = os.path.join(script.out, f"plain_rank{dist.get_rank()}.json")
    with open(plain_config, "w") as f:
        json.dump(plain, f)
    for key in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):  # set by the first TrainingArguments
        os.environ.pop(key, None)
    AcceleratorState._reset_state()  # accelerate's PartialState (the process group) is kept
    plain_args, _ = parser.parse_args_into_dataclasses(args=plain_argv(argv, plain_config))
    runs["plain"] = train(plain_args, data)
    torch.save({"runs": runs, "world_size": dist.get_world_size(), "trainer_world_size": args.world_size},
               os.path.join(script.out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
