"""owner_reduce: reduce each ZeRO-1/2 gradient only to the rank that keeps it, under DeepSpeed DeepCompile.

Opt-in: ``owner_reduce.install()`` once, then ``compile.reduce_to_owner`` (and the other keys of
``planning.settings``) in the DeepSpeed config; ``python -m owner_reduce.run SCRIPT`` installs it for a script that
cannot be edited. Importing this package imports neither torch nor DeepSpeed, and changes nothing DeepSpeed does with
a config it accepts: a config carrying owner_reduce's keys before ``install()``, which DeepSpeed refuses anyway, then
fails naming ``install()`` (``wiring.install_guard``).

What is exported here is what users call: ``install``, ``uninstall``, ``is_installed``, the errors (every one an
``OwnerReduceError``: ``errors``) and ``__version__``. The planning types (the owner map, the settings, the flags)
are imported from their modules.
"""

from .errors import (
    OwnerMapError,
    OwnerReduceConfigError,
    OwnerReduceError,
    OwnerReduceInstallError,
    OwnerReduceInUseError,
    OwnerReduceMismatchError,
    UnknownAlgorithmError,
    UnknownCallKindError,
    UnknownStepError,
)
from .runtime.deadline import OwnerReduceCommError
from .version import __version__ as __version__
from .wiring.install import install, is_installed, uninstall
from .wiring.install_guard import arm as _arm_install_guard

_arm_install_guard()


__all__ = [
    "OwnerMapError",
    "OwnerReduceCommError",
    "OwnerReduceConfigError",
    "OwnerReduceError",
    "OwnerReduceInUseError",
    "OwnerReduceInstallError",
    "OwnerReduceMismatchError",
    "UnknownAlgorithmError",
    "UnknownCallKindError",
    "UnknownStepError",
    "__version__",
    "install",
    "is_installed",
    "uninstall",
]
