"""What owner_reduce adds to DeepSpeed's checkpoints and to ZeRO's re-links, without processes: the client state in and
out of ``save_checkpoint`` / ``load_checkpoint`` (``wiring.checkpoint``), and the gradient fragments kept live across
every ``_link_all_hp_params`` (``wiring.full_grad`` Note (re-links))."""

from __future__ import annotations

import types

import pytest

from owner_reduce.planning.verdict_book import CHECKPOINT_KEY
from owner_reduce.wiring import checkpoint
from owner_reduce.wiring.full_grad import LiveGradientDict, keep_live_gradients


class _Engine:
    """The two methods as DeepSpeed 0.19.8 declares them; records what reached them."""

    def __init__(self, client_state_back=None) -> None:
        self.saved: list[dict] = []
        self.client_state_back = client_state_back

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DeepSpeed's
                        exclude_frozen_parameters=False):
        self.saved.append(dict(client_state))
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return (f"{load_dir}/model.pt", dict(self.client_state_back or {})) if load_dir else (None, None)


class _Runtime:
    def __init__(self, state) -> None:
        self.state, self.restored, self.comm = state, [], object()

    def checkpoint_state(self):
        return self.state

    def restore_checkpoint_state(self, data, source):
        self.restored.append((data, source))


def _wrapped(engine_cls=_Engine):
    cls = type("Wrapped", (engine_cls,), {})
    cls.save_checkpoint = checkpoint.wrap_save_checkpoint(engine_cls.save_checkpoint)
    cls.load_checkpoint = checkpoint.wrap_load_checkpoint(engine_cls.load_checkpoint)
    return cls


def test_save_adds_the_runtimes_state_to_a_copy_of_the_client_state_and_refuses_a_clash():
    engine = _wrapped()()
    mine = {"epoch": 3}
    engine.save_checkpoint("d", client_state=mine)  # no runtime on this engine: DeepSpeed's call as it was
    setattr(engine, checkpoint.RUNTIME_ATTR, _Runtime({"format": "s"}))
    engine.save_checkpoint("d", "tag", mine)  # positional client_state too
    engine.save_checkpoint("d")
    state = {CHECKPOINT_KEY: {"format": "s"}}
    assert engine.saved == [{"epoch": 3}, {"epoch": 3, **state}, state]
    assert mine == {"epoch": 3}  # the caller's dict is not changed
    with pytest.raises(KeyError, match=f"client_state holds '{CHECKPOINT_KEY}'"):
        engine.save_checkpoint("d", client_state={CHECKPOINT_KEY: 1})
    setattr(engine, checkpoint.RUNTIME_ATTR, _Runtime(None))  # nothing learned yet: nothing added
    engine.save_checkpoint("d", client_state=mine)
    assert engine.saved[-1] == {"epoch": 3}


def test_load_takes_the_state_out_for_the_live_runtime_or_keeps_it_for_the_next_one():
    engine = _wrapped()(client_state_back={"epoch": 3, CHECKPOINT_KEY: {"format": "s"}})
    path, client = engine.load_checkpoint("d")  # no runtime yet (load before engine.compile())
    assert (path, client) == ("d/model.pt", {"epoch": 3})
    runtime = _Runtime(None)
    checkpoint.hand_pending_verdicts(engine, runtime)  # the runtime DeepCompile starts next gets it
    assert runtime.restored == [({"format": "s"}, "the checkpoint d/model.pt")]
    checkpoint.hand_pending_verdicts(engine, runtime)
    assert len(runtime.restored) == 1  # once
    setattr(engine, checkpoint.RUNTIME_ATTR, runtime)  # compile, then load: to the live runtime at once
    engine.load_checkpoint("e")
    assert runtime.restored[-1] == ({"format": "s"}, "the checkpoint e/model.pt")
    assert engine.load_checkpoint(None) == (None, None)  # DeepSpeed found no checkpoint: untouched


def test_the_surface_check_knows_the_two_methods_and_the_relink():
    from owner_reduce.wiring.surface import surface_problems

    assert surface_problems() == []


class _Mapping:
    def __init__(self, gradient_dict) -> None:
        self.gradient_dict = gradient_dict


class _Zero:
    """ZeRO 1/2's re-link: new mappings bound to the gradient dict of that moment (stage_1_and_2.py)."""

    def __init__(self) -> None:
        self.averaged_gradients = {0: "first"}
        self.params = [types.SimpleNamespace(), types.SimpleNamespace()]
        self.relinks = 0
        self._link_all_hp_params()

    def _link_all_hp_params(self) -> None:
        self.relinks += 1
        for p in self.params:
            p._hp_mapping = _Mapping(self.averaged_gradients)


def test_every_relink_zero_makes_keeps_the_mappings_live():
    zero = _Zero()
    assert keep_live_gradients(zero, lambda: zero.params) == 2
    keep_live_gradients(zero, lambda: zero.params)  # twice: wrapped once
    zero.averaged_gradients = {0: "second"}  # DeepCompile's pre-backward hook binds a new dict each step
    assert all(p._hp_mapping.gradient_dict[0] == "second" for p in zero.params)
    zero._link_all_hp_params()  # load_checkpoint / reload_states: fresh mappings, bound to the current dict
    zero.averaged_gradients = {0: "third"}
    assert all(isinstance(p._hp_mapping.gradient_dict, LiveGradientDict) for p in zero.params)
    assert all(p._hp_mapping.gradient_dict[0] == "third" for p in zero.params) and zero.relinks == 2
