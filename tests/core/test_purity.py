"""The pure core stays pure: no clock, randomness, I/O, logging, async or torch anywhere under
``kvflow/core`` (nor in the KV-event derivation); ``import kvflow`` (and the manager, replay
and log) never pulls torch in; state/decide never iterate a set; and a seeded run is the same
under two ``PYTHONHASHSEED`` values (digest and trace bytes)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvflow"


def _modules_under(folder: Path) -> list[str]:
    return [
        ".".join(
            p.relative_to(ROOT).with_suffix("").parts[:-1]
            if p.stem == "__init__"
            else p.relative_to(ROOT).with_suffix("").parts
        )
        for p in sorted(folder.rglob("*.py"))
    ]


# The pure core is a folder: every module under kvflow/core.
PURE_MODULES = _modules_under(PACKAGE / "core")
# Modules outside the core that must stay as pure ("a function of the events": its docstring).
ALSO_PURE = ["kvflow.integrations.vllm.kv_events"]
# What the pure modules may import from kvflow itself (errors is plain exception classes).
PURE_INTERNAL = set(PURE_MODULES)

FORBIDDEN = {
    "time",
    "datetime",
    "random",
    "secrets",
    "os",
    "io",
    "sys",
    "socket",
    "logging",
    "structlog",
    "asyncio",
    "anyio",
    "threading",
    "subprocess",
    "torch",
    "numpy",
    "pathlib",
    "gzip",
    "uuid",
}


def module_path(module: str) -> Path:
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported_modules(module: str) -> list[tuple[int, str]]:
    """Every module imported anywhere in ``module`` (top level, functions, TYPE_CHECKING)."""
    path = module_path(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from kvflow import x`` may name a submodule
            found += [
                (node.lineno, f"{target}.{alias.name}")
                for alias in node.names
                if module_path_exists(f"{target}.{alias.name}")
            ]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def module_path_exists(module: str) -> bool:
    if not module.startswith("kvflow."):
        return False
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return path.is_dir() or path.with_suffix(".py").exists()


@pytest.mark.parametrize("module", [*PURE_MODULES, *ALSO_PURE])
def test_pure_module_imports_no_clock_randomness_io_logging_async_or_torch(module: str) -> None:
    bad = [
        f"{module_path(module).relative_to(ROOT)}:{line}: import {name}"
        for line, name in imported_modules(module)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert bad == []


@pytest.mark.parametrize("module", [*PURE_MODULES, *ALSO_PURE])
def test_pure_module_imports_only_pure_kvflow_modules(module: str) -> None:
    internal = {name for _, name in imported_modules(module) if name.split(".")[0] == "kvflow"}
    assert internal <= PURE_INTERNAL, internal - PURE_INTERNAL


def test_the_import_checker_sees_nested_imports() -> None:
    # guard against a vacuous check: config imports the policy registry inside a function
    config_imports = {name for _, name in imported_modules("kvflow.core.config")}
    assert "kvflow.core.policies.registry" in config_imports and "msgspec" in config_imports
    assert "kvflow.core.policies.arc" in {
        name for _, name in imported_modules("kvflow.core.policies.registry")
    }


IMPORT_CHECK = textwrap.dedent(
    """
    import sys
    import kvflow
    after_package = "torch" in sys.modules
    import kvflow.engine.manager, kvflow.replay.fold, kvflow.log.memory
    import kvflow.core.jobs, kvflow.core.events, kvflow.core.commands, kvflow.core.state, kvflow.core.decide.dispatch, kvflow.core.config, kvflow.core.policies.registry
    import kvflow.integrations.vllm.kv_events
    print(after_package, "torch" in sys.modules)
    """
)


def test_importing_kvflow_and_its_core_never_imports_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# --- never iterate a set where order matters -----------------------------------------------


def _is_set_value(node: ast.AST | None) -> bool:
    if isinstance(node, (ast.Set, ast.SetComp)):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in ("set", "frozenset")
    return False


def set_iterations(source: str, filename: str = "<source>") -> list[str]:
    """``for x in S`` (loops and comprehensions) where S is a set literal / set() call, or a
    name assigned one in the same function. Simple and honest: no flow analysis."""
    tree = ast.parse(source, filename=filename)
    problems = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        set_names = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and _is_set_value(node.value):
                set_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if _is_set_value(node.value):
                    set_names.add(node.target.id)
        for node in ast.walk(scope):
            iters = []
            if isinstance(node, (ast.For, ast.AsyncFor)):
                iters.append(node.iter)
            elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                iters += [g.iter for g in node.generators]
            for it in iters:
                if _is_set_value(it) or (isinstance(it, ast.Name) and it.id in set_names):
                    problems.append(f"{filename}:{it.lineno}: iterates a set ({ast.unparse(it)})")
    return sorted(set(problems))


def test_the_set_iteration_checker_flags_what_it_should() -> None:
    source = textwrap.dedent(
        """
        def bad(xs):
            seen = set(xs)
            out = [x for x in seen]
            for y in {1, 2}:
                out.append(y)
            return out

        def good(xs):
            seen: set[int] = set()
            for x in xs:
                if x in seen:
                    continue
                seen.add(x)
            return sorted(seen)
        """
    )
    problems = set_iterations(source)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "iterates a set (seen)",
        "iterates a set ({1, 2})",
    ]


@pytest.mark.parametrize(
    "path", [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "core").rglob("*.py"))]
)
def test_state_and_decisions_never_iterate_a_set(path: str) -> None:
    file = PACKAGE / path
    assert set_iterations(file.read_text(encoding="utf-8"), str(file.relative_to(ROOT))) == []


# --- determinism across hash seeds ---------------------------------------------------------

DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import hashlib, random, sys
    from kvflow.core.config import Config
    from kvflow.core.errors import Rejected
    from kvflow.log.writer import TraceWriter
    from kvflow.engine.manager import OffloadManager
    from kvflow.core.state.tables import JobState
    from kvflow.core.jobs import ranks_missing

    seed, path, policy = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rng = random.Random(seed)
    config = Config(
        cpu_blocks=12, block_tokens=4, policy=policy, world_size=2, job_deadline_ms=50.0
    )
    m = OffloadManager(config, log=TraceWriter(path, config, checkpoint_every=25))
    now, device_block = 0.0, 0
    names = [f"request-{i}" for i in range(6)]  # str keys: their hash order varies with the seed
    def fresh(n):
        global device_block
        device_block += n
        return list(range(device_block - n, device_block))
    for _ in range(1500):
        op = rng.randrange(10)
        rid = rng.choice(names)
        hashes = rng.sample(range(24), rng.randint(1, 5))
        try:
            if op == 0:
                m.lookup(rid, hashes, len(hashes) * 4 + rng.randint(-4, 3))
            elif op == 1 and rid in m.state.requests:
                m.accept_hits(rid, fresh(rng.randint(0, len(m.state.requests[rid].offered))))
            elif op == 2:
                m.blocks_computed(rid, hashes, fresh(len(hashes)))
            elif op == 3:
                m.plan_step(now)
            elif op == 4:
                live = [
                    j
                    for j in m.state.jobs.values()
                    if j.state in (JobState.IN_FLIGHT, JobState.ABANDONED)
                ]
                if live:
                    job = rng.choice(live)
                    ranks = ranks_missing(job.acks, 2)
                    ok = rng.random() < 0.85
                    m.job_result(job.job_id, rank=rng.choice(ranks), ok=ok, error="x")
            elif op == 5:
                now += rng.choice([1.0, 10.0, 40.0])
                m.tick(now)
            elif op == 6:
                m.finish_request(rid, preempted=rng.random() < 0.3)
            elif op == 7:
                m.touch(hashes)
            elif op == 8:
                m.evict(rng.randint(1, 3))
            elif op == 9 and rng.random() < 0.05:
                slots = [s for j in m.state.jobs.values() if j.direction == "load" for s in j.slots]
                if len(slots) == len(set(slots)):  # a known reset bug otherwise
                    m.reset()
        except Rejected:
            pass
    digest = m.state.digest()
    m.close()
    with open(path, "rb") as fh:
        print(digest, m.state.last_seq, hashlib.sha256(fh.read()).hexdigest())
    """
)


def run_seeded(tmp_path: Path, hash_seed: str, seed: int, policy: str) -> str:
    script = tmp_path / "determinism.py"
    script.write_text(DETERMINISM_SCRIPT, encoding="utf-8")
    trace = tmp_path / f"trace-{hash_seed}-{seed}-{policy}.jsonl"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, str(script), str(seed), str(trace), policy],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_same_seed_gives_the_same_digest_and_trace_under_two_hash_seeds(tmp_path: Path, policy: str) -> None:
    first = run_seeded(tmp_path, "0", seed=7, policy=policy)
    second = run_seeded(tmp_path, "4242", seed=7, policy=policy)
    assert first == second
    digest, last_seq, _ = first.split()
    assert int(last_seq) > 500, "the run should do real work"
    # sanity: the output depends on the seed (the comparison above is not vacuous)
    assert run_seeded(tmp_path, "0", seed=8, policy=policy).split()[0] != digest
