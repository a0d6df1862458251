"""Keys for the shared tiers' tests: keys files written as a user would (mode 0600), with fixed
keys so that every process of a test (a writer, a reader) holds the same ones."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvflow.tiers.keys import TierKeys

KEY = bytes.fromhex("8f1c2ab3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f")
NEW_KEY = bytes.fromhex("0badc0ffee0ddf00d5eed5a1ab1e5eaf00d0badc0ffee0ddf00d5eed5a1ab1e5")
OTHER_KEY = bytes.fromhex("3c3c3c3c5a5a5a5a9696969669696969a5a5a5a5c3c3c3c3f0f0f0f00f0f0f0f")


def keys_file(directory: Path, *masters: bytes, name: str = "tier.keys") -> Path:
    """A keys file in ``directory`` holding ``masters`` (the first writes), mode 0600."""
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        f.write("# the shared tiers' keys: the first writes\n")
        f.writelines(m.hex() + "\n" for m in (masters or (KEY,)))
    os.chmod(path, 0o600)
    return path


def tier_keys(*masters: bytes) -> TierKeys:
    """``TierKeys`` of ``masters`` (default: ``KEY``), read from a keys file of their own."""
    return TierKeys.from_file(keys_file(Path(tempfile.mkdtemp(prefix="kvflow-keys-")), *masters))
