"""Re-run every ``$ kvflow ...`` command pasted in docs/debugging.md and paste its
real output under it (commands piped into ``head -n N`` are cut the same way; other pipes are
left alone). ``tests/cli/test_cli.py`` checks that the pasted output is what the commands print.

Usage: python tools/update_doc_outputs.py
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "debugging.md"]
HEAD = re.compile(r"^(?P<cmd>kvflow .*?)(?: \| head -n (?P<n>\d+))?$")


def run(command: str) -> str | None:
    match = HEAD.match(command)
    if match is None or any(c in match.group("cmd") for c in "|;"):
        return None
    args = shlex.split(match.group("cmd"))
    env = dict(os.environ, COLUMNS="140")
    exe = str(Path(sys.executable).parent / "kvflow")
    out = subprocess.run([exe, *args[1:]], cwd=ROOT, capture_output=True, text=True, env=env).stdout
    if match.group("n"):
        out = "".join(out.splitlines(keepends=True)[: int(match.group("n"))])
    return out


def main() -> int:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        parts = text.split("```console\n")
        for i, block in enumerate(parts[1:], start=1):
            body, sep, rest = block.partition("```")
            command = body.partition("\n")[0].removeprefix("$ ")
            output = run(command)
            if output is not None:
                parts[i] = f"$ {command}\n{output}{sep}{rest}"
        doc.write_text("```console\n".join(parts), encoding="utf-8")
        print(f"updated {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
