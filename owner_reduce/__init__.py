"""owner_reduce: reduce each ZeRO-1 gradient only to the rank that keeps it, under DeepSpeed DeepCompile.

Opt-in: ``owner_reduce.install()`` once, then ``compile.reduce_to_owner`` / ``compile.reduce_probe`` in the
DeepSpeed config. Importing this package changes nothing in DeepSpeed.
"""

from .planning.flags import FLAG_KEYS, OwnerReduceConfigError, OwnerReduceFlags, flags_of, parse_flags
from .planning.owner_map import GroupTables, OwnerMap, OwnerMapError, ParamPlacement, ParamSlice, Placement
from .runtime.deadline import OwnerReduceCommError
from .wiring.install import OwnerReduceInstallError, OwnerReduceInUseError, install, is_installed, uninstall

__version__ = "0.1.0"


def build_owner_map(engine):  # noqa: ANN001, ANN201 - thin lazy wrapper, see engine_tables.build_owner_map
    """The owner map of a DeepSpeed ZeRO-1 engine (imports deepspeed.comm only when called)."""
    from .wiring.engine_tables import build_owner_map as _build

    return _build(engine)


__all__ = [
    "FLAG_KEYS",
    "GroupTables",
    "OwnerMap",
    "OwnerMapError",
    "OwnerReduceCommError",
    "OwnerReduceConfigError",
    "OwnerReduceFlags",
    "OwnerReduceInUseError",
    "OwnerReduceInstallError",
    "ParamPlacement",
    "ParamSlice",
    "Placement",
    "build_owner_map",
    "flags_of",
    "install",
    "is_installed",
    "parse_flags",
    "uninstall",
]
