"""The policies ``Config.policy`` can name: a built-in by its name (``lru``, ``arc``), or a
class of one's own by ``"package.module:ClassName"``.

A class of one's own is loaded with ``importlib.import_module``, which is what an ``import``
statement does: Python's import system finds the module on its path. The loader lives here, in
the pure core, because turning a ``Config.policy`` name into a class is this module's one job
whichever kind of name it is, and ``Config`` checks its fields in the core, when it is built.
An import is none of the effects the core forbids itself: this code opens no file, reads no
environment variable, touches no clock or randomness, and the same name always loads the same
class, so decisions stay a function of the config and the commands.

The class is checked before any state is built: a subclass of ``Policy``, every abstract
method implemented, and every method the state calls able to take that call's arguments.
Whatever does not fit is a ``ConfigError`` with a one-line message (F11). The trace header
records the name, so replay loads the same class, and refuses the trace, in one line, where it
cannot.
"""

from __future__ import annotations

import importlib
import inspect

from kvflow.core.errors import ConfigError, PolicyError, one_line
from kvflow.core.policies.arc import ARCPolicy
from kvflow.core.policies.base import Policy
from kvflow.core.policies.lru import LRUPolicy
from kvflow.core.values import is_int

# The built-in policies by name; every policy class is built as ``cls(capacity)``.
POLICIES: dict[str, type[Policy]] = {LRUPolicy.name: LRUPolicy, ARCPolicy.name: ARCPolicy}


def _nothing_pinned(block_hash: int) -> bool:
    return False


# How the state calls a policy: each method with the parameters it is given and a sample of
# them, bound (not called) against the method's signature to find one that cannot take them.
_CALLS: dict[str, tuple[tuple[str, ...], tuple[object, ...]]] = {
    "__init__": (("capacity",), (8,)),
    "insert": (("block_hash",), (1,)),
    "touch": (("block_hash",), (1,)),
    "refresh": (("block_hash",), (1,)),
    "remove": (("block_hash",), (1,)),
    "victims": (("num_blocks", "pinned"), (1, _nothing_pinned)),
    "resident": ((), ()),
    "snapshot": ((), ()),
    "clear": ((), ()),
    "__len__": ((), ()),
    "insert_many": (("hashes",), ((1,),)),
    "touch_many": (("hashes",), ((1,),)),
    "refresh_many": (("hashes",), ((1,),)),
    "remove_many": (("hashes",), ((1,),)),
}


def policy_class(name: str) -> type[Policy]:
    """The policy class ``name`` names, checked; ``ConfigError`` (one line) if it names none
    or the class does not fit (see the module docstring)."""
    if not isinstance(name, str):
        raise ConfigError(f"policy must be a string (a built-in name or 'module:Class'), got {name!r}")
    cls = POLICIES.get(name)
    if cls is not None:
        return cls
    module_name, colon, class_name = name.partition(":")
    if not colon:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(
            f"unknown policy {name!r}; known policies: {known}, or a class of your own as 'module:Class'"
        )
    if not module_name or not class_name.isidentifier():
        raise ConfigError(f"policy {name!r}: name a class of your own as 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # (whatever the module raises while it loads)
        raise ConfigError(f"policy {name!r}: cannot import {module_name!r}: {one_line(exc)}") from None
    found = getattr(module, class_name, None)
    if found is None:
        raise ConfigError(f"policy {name!r}: module {module_name!r} has no {class_name!r}")
    if not (isinstance(found, type) and issubclass(found, Policy)):
        raise ConfigError(f"policy {name!r}: {class_name} is not a subclass of kvflow.Policy")
    missing = sorted(getattr(found, "__abstractmethods__", ()))
    if missing:
        raise ConfigError(f"policy {name!r}: {class_name} does not implement {', '.join(missing)}")
    for method, (params, sample) in _CALLS.items():
        try:
            inspect.signature(getattr(found, method)).bind(None, *sample)  # (Policy has each)
        except (TypeError, ValueError):
            wanted = f"{method}({', '.join(('self', *params))})"
            raise ConfigError(f"policy {name!r}: {class_name}.{method} cannot be called as {wanted}") from None
    return found


def make_policy(name: str, capacity: int) -> Policy:
    """A fresh, empty policy ``name`` for a tier of ``capacity`` blocks."""
    cls = policy_class(name)
    if not is_int(capacity) or capacity < 0:
        raise ConfigError(f"policy capacity must be an int >= 0, got {capacity!r}")
    try:
        return cls(capacity)
    except ConfigError:
        raise
    except Exception as exc:
        raise PolicyError(f"policy {name!r}: {cls.__name__}({capacity}) raised {one_line(exc)}") from exc


__all__ = ["POLICIES", "make_policy", "policy_class"]
