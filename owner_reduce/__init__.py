"""owner_reduce: reduce each ZeRO-1/2 gradient only to the rank that keeps it, under DeepSpeed DeepCompile.

Opt-in: ``owner_reduce.install()`` once, then ``compile.reduce_to_owner`` (and the other keys of
``planning.settings``) in the DeepSpeed config. Importing this package imports neither torch nor DeepSpeed, and
changes nothing DeepSpeed does with a config it accepts: a config carrying owner_reduce's keys before ``install()``,
which DeepSpeed refuses anyway, then fails naming ``install()`` (``wiring.install_guard``).
"""

from .planning.flags import FLAG_KEYS, OwnerReduceConfigError, OwnerReduceFlags, flags_of, parse_flags
from .planning.owner_map import GroupTables, OwnerMap, OwnerMapError, ParamPlacement, ParamSlice, Placement
from .planning.settings import SETTING_KEYS, OwnerReduceSettings, parse_settings, settings_of
from .runtime.deadline import OwnerReduceCommError
from .runtime.errors import OwnerReduceMismatchError
from .version import __version__ as __version__
from .wiring.install import OwnerReduceInstallError, OwnerReduceInUseError, install, is_installed, uninstall
from .wiring.install_guard import arm as _arm_install_guard

_arm_install_guard()


def build_owner_map(engine):  # noqa: ANN001, ANN201 - thin lazy wrapper, see engine_tables.build_owner_map
    """The owner map of a DeepSpeed ZeRO-1 engine (imports deepspeed.comm only when called)."""
    from .wiring.engine_tables import build_owner_map as _build

    return _build(engine)


__all__ = [
    "FLAG_KEYS",
    "SETTING_KEYS",
    "GroupTables",
    "OwnerMap",
    "OwnerMapError",
    "OwnerReduceCommError",
    "OwnerReduceConfigError",
    "OwnerReduceFlags",
    "OwnerReduceInUseError",
    "OwnerReduceInstallError",
    "OwnerReduceMismatchError",
    "OwnerReduceSettings",
    "ParamPlacement",
    "ParamSlice",
    "Placement",
    "build_owner_map",
    "flags_of",
    "install",
    "is_installed",
    "parse_flags",
    "parse_settings",
    "settings_of",
    "uninstall",
]
