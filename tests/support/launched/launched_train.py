"""A small DeepSpeed training script that knows nothing of owner_reduce (it never imports it): the tests start it
through ``python -m owner_reduce.run`` under ``accelerate launch`` (and ``launched_trainer.py`` builds its model).

A tiny Llama built from a config (no download) trains a few steps on random tokens (different on every rank) for
each variant (ZeRO stage, gradient accumulation), first with the DeepSpeed config as given (DeepCompile, the two
keys), then, in the same process group, as plain ZeRO of the same stage without ``compile`` (the reference). Each
rank writes its losses, final parameters, what DeepCompile's handle was and its counters to ``--out``.

``--api accelerate``: ``Accelerator`` + ``prepare`` with the DeepSpeed config file that ``accelerate launch``'s
config names (``deepspeed_config_file``), then ``model.compile()`` as DeepSpeed's DeepCompile benchmark does.
(DeepSpeed's own launcher runs ``launched_settings.py``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

VOCAB, SEQ, MICRO_BATCH, LR = 96, 16, 2, 1e-2


def build_model():  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def batches(rank: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(count)]


def handle_report() -> dict:
    """What DeepCompile's handle is, and its counters where it has them (owner_reduce's runtime does)."""
    from deepspeed.compile import util

    handle = util.dc_handle
    stats = getattr(handle, "stats", None)
    fields = {} if stats is None or not dataclasses.is_dataclass(stats) else {
        k: v for k, v in dataclasses.asdict(stats).items() if isinstance(v, (int, str, list)) or v is None}
    return {"handle": None if handle is None else f"{type(handle).__module__}.{type(handle).__qualname__}",
            "stats": fields}


def train_steps(engine, rank: int, steps: int, grad_accum: int) -> list[float]:  # noqa: ANN001
    losses = []
    for tokens in batches(rank, steps * grad_accum):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def config_variant(config: dict, stage: int, grad_accum: int, compiled: bool) -> dict:
    out = json.loads(json.dumps(config))
    out["zero_optimization"] = {**out.get("zero_optimization", {}), "stage": stage}
    out["gradient_accumulation_steps"] = grad_accum
    if not compiled:
        out.pop("compile", None)
    return out


def run_accelerate(config: dict, stage: int, grad_accum: int, compiled: bool, args: argparse.Namespace) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state()  # one Accelerator per variant in this process (PartialState is kept)
    plugin = DeepSpeedPlugin(hf_ds_config=config_variant(config, stage, grad_accum, compiled))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=grad_accum)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _ = accelerator.prepare(model, optimizer)
    if compiled:
        engine.compile(backend=args.backend)
    return {**finish(engine, grad_accum, args), "accelerate_processes": accelerator.num_processes}


def finish(engine, grad_accum: int, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import deepspeed.comm as dist

    rank = dist.get_rank()
    losses = train_steps(engine, rank, args.steps, grad_accum)
    report = handle_report()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, **report}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("accelerate",), required=True)
    parser.add_argument("--variants", default="1:1", help="stage:grad_accum,... ('' trains nothing)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with open(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) as f:
        config = json.load(f)
    import deepspeed.comm as dist

    results = {"world_size": None, "runs": {}}
    for variant in filter(None, args.variants.split(",")):
        stage, grad_accum = (int(x) for x in variant.split(":"))
        for compiled in (True, False):
            results["runs"][f"{variant}:{'dc' if compiled else 'plain'}"] = run_accelerate(config, stage, grad_accum,
                                                                                            compiled, args)
    results["world_size"] = dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    torch.save(results, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
