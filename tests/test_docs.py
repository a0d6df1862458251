"""The user documentation stands on its own: every Python block of README.md,
docs/embedding.md and docs/simulate.md runs as written, every ``kvflow ...`` command the README and docs/simulate.md
show exits as documented, every relative link leads to a file of the repository, and no document
leans on what a user of the repository does not have (files outside it, issue numbers, the
story of how the code was written)."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The documents a user reads: the README, docs/, and the notes beside the golden traces
# (CHANGELOG.md, a history by nature, is not one of them).
USER_DOCS = sorted([ROOT / "README.md", *DOCS.glob("**/*.md"), ROOT / "traces" / "README.md"])
RUN_PYTHON = [
    ROOT / "README.md", DOCS / "embedding.md", DOCS / "simulate.md", DOCS / "disk-tier.md", DOCS / "tier-keys.md",
    DOCS / "transformers.md",
]
RUN_COMMANDS = [ROOT / "README.md", DOCS / "simulate.md"]

FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)


def blocks(path: Path, *languages: str) -> list[tuple[int, str]]:
    """(line of the opening fence, body) of every fenced block in one of ``languages``."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group(2)))
        for m in FENCE.finditer(text)
        if m.group(1) in languages
    ]


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, COLUMNS="140")


@functools.cache
def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_transformers() -> bool:
    if os.environ.get("KVFLOW_REQUIRE_TRANSFORMERS"):  # CI: a missing transformers fails the block
        return True
    try:
        import psutil  # noqa: F401  (transformers sizes its cache on the CPU device with it)
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# -- Python blocks ------------------------------------------------------------------------


PY_BLOCKS = [
    pytest.param(body, id=f"{path.relative_to(ROOT)}:{line}")
    for path in RUN_PYTHON
    for line, body in blocks(path, "python")
]


def test_the_documents_have_python_to_run() -> None:
    assert {str(p.id).split(":")[0] for p in PY_BLOCKS} == {
        "README.md", "docs/embedding.md", "docs/simulate.md", "docs/disk-tier.md", "docs/tier-keys.md",
        "docs/transformers.md",
    }


@pytest.mark.parametrize("code", PY_BLOCKS)
def test_a_python_block_runs_as_written(code: str, tmp_path: Path) -> None:
    """Each block alone, in a fresh interpreter, from an empty folder (what it writes stays there)."""
    if re.search(r"\btorch\b|TorchExecutor", code) and not has_torch():
        pytest.skip("needs torch")
    if "transformers" in code and not has_transformers():
        pytest.skip("needs transformers and psutil (pip install 'kvflow[transformers]'; CI installs them)")
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


# -- kvflow commands ----------------------------------------------------------------------


def command_lines(path: Path) -> list[tuple[int, str, int]]:
    """(line, command, documented exit status) of every ``kvflow ...`` a shell block shows.
    A command is a line, or a part of one between ``&&``; a trailing ``# exit status N``
    documents a status other than 0."""
    found = []
    for start, body in blocks(path, "bash", "sh", "shell"):
        for offset, text in enumerate(body.splitlines(), start=1):
            command, _, comment = text.partition("  #")
            status = re.search(r"exit status (\d+)", comment)
            for part in command.split("&&"):
                part = part.strip()
                if part.startswith("kvflow "):
                    found.append((start + offset, part, int(status.group(1)) if status else 0))
    return found


COMMANDS = [
    pytest.param(path, line, command, status, id=f"{path.relative_to(ROOT)}:{line}")
    for path in RUN_COMMANDS
    for line, command, status in command_lines(path)
]


def test_the_documents_have_commands_to_run() -> None:
    assert {str(p.id).split(":")[0] for p in COMMANDS} == {"README.md", "docs/simulate.md"}


def kvflow(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    args = shlex.split(command)[1:]
    return subprocess.run(
        [sys.executable, "-m", "kvflow", *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=600
    )


def recorded(command: str) -> str | None:
    args = shlex.split(command)
    return args[args.index("--record") + 1] if "--record" in args else None


@pytest.mark.parametrize(("path", "line", "command", "status"), COMMANDS)
def test_a_documented_command_exits_as_documented(
    path: Path, line: int, command: str, status: int, tmp_path: Path
) -> None:
    """From a folder holding only the repository's bundled traces: a command that reads a trace
    an earlier command of the same document records runs that command first."""
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    names = set(shlex.split(command)[1:])
    before = [
        c for ln, c, _ in command_lines(path) if ln < line and recorded(c) is not None and recorded(c) in names
    ]
    for earlier in before:
        assert kvflow(earlier, tmp_path).returncode == 0, earlier
    done = kvflow(command, tmp_path)
    assert done.returncode == status, f"{command}\n{done.stderr}"
    assert "Traceback" not in done.stderr


# -- what a document may lean on ----------------------------------------------------------

FORBIDDEN = [
    (re.compile(r"\.\./shared|/work/"), "a path outside the repository"),
    (re.compile(r"\bDESIGN\b|§\s*\d"), "a design document users do not have"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w&/#])#\d+\b"), "an issue or pull-request number"),
    (re.compile(r"\bsessions?\b", re.I), "how the code was written"),
]
# "session" is also a routing of `kvflow simulate --instances` (by a request's first block)
ROUTING = re.compile(r"--routing session|session[- ]affin\w*|session routing", re.I)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_document_leans_only_on_the_repository(path: Path) -> None:
    text = ROUTING.sub(lambda m: "~" * len(m.group(0)), path.read_text(encoding="utf-8"))
    problems = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {why}: {m.group(0)!r}"
        for pattern, why in FORBIDDEN
        for m in pattern.finditer(text)
    ]
    assert problems == []


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown renderer gives the headings of ``path`` (lower case, punctuation
    dropped, spaces as hyphens)."""
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_of_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    broken = []
    for link in sorted({m.group(1) for m in LINK.finditer(text)}):
        if "://" in link or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        inside = resolved.is_relative_to(ROOT)
        if not inside or not resolved.exists():
            broken.append(link)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(link)
    assert broken == []


def ci_script() -> str:
    """``.ci/run`` with its continued lines joined and its spaces collapsed."""
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8").replace("\\\n", " ")
    return re.sub(r"[ \t]+", " ", text)


def test_the_readme_is_short_and_opens_with_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    first_two = [body.strip() for _, body in blocks(ROOT / "README.md", "bash")[:2]]
    assert first_two[0] == "pip install . && kvflow simulate --example"
    assert first_two[1].endswith("-m pytest -q -n auto")
    assert text.index(first_two[0]) < text.index("\n## ")  # before the first section
    # the README's test command is what CI runs, part for part
    for part in first_two[1].split("&&"):
        assert part.strip() in ci_script(), part


def test_the_documented_vllm_test_command_is_what_ci_runs() -> None:
    (command,) = [body for _, body in blocks(DOCS / "development.md", "bash") if ".venv-vllm" in body]
    parts = [part.strip() for part in command.split("&&")]
    assert parts[-1].startswith("KVFLOW_REQUIRE_VLLM=1 ") and "pytest" in parts[-1]
    for part in parts:
        assert part in ci_script(), part


VLLM_FLAGS = [
    pytest.param(body, id=f"{path.relative_to(ROOT)}:{start}")
    for path in USER_DOCS
    for start, body in blocks(path, "bash", "sh", "shell")
    if "vllm serve" in body and "--kv-transfer-config" in body
]


def test_the_documents_show_vllm_flags() -> None:
    assert {str(p.id).split(":")[0] for p in VLLM_FLAGS} >= {"README.md", "docs/remote-tier.md", "docs/disk-tier.md"}


@pytest.mark.parametrize("body", VLLM_FLAGS)
def test_a_documented_vllm_flag_is_one_the_connector_accepts(body: str) -> None:
    """A ``vllm serve ... --kv-transfer-config '{...}'`` a user would paste: its JSON parses, names
    kvflow's connector, and its ``kv_connector_extra_config`` passes the connector's checks."""
    from kvflow.integrations.vllm.sides import ConnectorConfig, check_shared_hashes

    flag = json.loads(body.split("--kv-transfer-config", 1)[1].strip().split("'")[1])
    assert flag["kv_connector"] == "KVFlowConnector"
    assert flag["kv_connector_module_path"] == "kvflow.integrations.vllm.connector"
    extra = dict(flag["kv_connector_extra_config"])
    if ":" in str(extra.get("policy", "")):  # a policy of the user's own module (docs/policies.md)
        extra.pop("policy")
    config = ConnectorConfig.from_extra(extra)
    check_shared_hashes(config, "sha256", {})  # (vLLM's default hash)


def test_the_conformance_documents_commands_and_profile_are_the_suites() -> None:
    """docs/conformance.md: its commands run the suite CI runs, with the variables the suite
    reads; the profile it shows has every attribute of the suite's profile interface."""
    path = DOCS / "conformance.md"
    suite = (ROOT / "tests" / "conformance" / "test_conformance.py").read_text(encoding="utf-8")
    commands = [body.strip() for _, body in blocks(path, "bash")]
    assert commands
    for command in commands:
        assert command.endswith(".venv-vllm/bin/python -m pytest -q tests/conformance"), command
        for name in re.findall(r"\b(KVFLOW_\w+)=", command):
            assert name == "KVFLOW_REQUIRE_VLLM" or f'"{name}"' in suite, name
    assert re.search(r"KVFLOW_REQUIRE_VLLM=1 \.venv-vllm/bin/python -m pytest -q [^\n]*tests/conformance\b", ci_script())
    (profile_block,) = [body for _, body in blocks(path, "python")]
    namespace: dict[str, object] = {}
    exec(compile(profile_block, str(path), "exec"), namespace)
    sys.path.insert(0, str(ROOT / "tests" / "conformance"))
    try:
        import conformance_profiles
    finally:
        sys.path.remove(str(ROOT / "tests" / "conformance"))
    interface = [name for name in vars(conformance_profiles.FaultProfile) if not name.startswith("_")]
    profile = namespace["PROFILE"]
    assert [name for name in interface if not hasattr(profile, name)] == []
    assert set(getattr(profile, "faults")) <= set(conformance_profiles.FAULTS)
    for name in conformance_profiles.FAULTS:
        assert name in path.read_text(encoding="utf-8").replace(" ", "_").lower(), name
