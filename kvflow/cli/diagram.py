"""The ``kvflow diagram`` verb: the block and job lifecycles, printed as text or Mermaid from the
transition tables in ``kvflow.core.state`` (so the picture cannot drift from the code).
"""

from __future__ import annotations

from typing import Any

import click


@click.command()
@click.argument("which", type=click.Choice(["both", "block", "job"]), default="both")
@click.option("--mermaid", is_flag=True, help="Mermaid stateDiagram-v2 instead of text.")
def diagram(which: str, mermaid: bool) -> None:
    """The block and job lifecycles, printed from kvflow.core.state's transition tables."""
    from kvflow.core.state.tables import (
        BLOCK_TRANSITIONS,
        JOB_TRANSITIONS,
        TERMINAL_JOB_STATES,
        BlockState,
        JobState,
    )

    tables: list[tuple[str, dict[Any, dict[str, Any]], Any, tuple[Any, ...]]] = []
    if which in ("both", "block"):
        tables.append(
            (
                "block lifecycle (kvflow.core.state.BLOCK_TRANSITIONS)",
                BLOCK_TRANSITIONS,
                BlockState.ABSENT,
                (),
            )
        )
    if which in ("both", "job"):
        tables.append(
            (
                "job lifecycle (kvflow.core.state.JOB_TRANSITIONS)",
                JOB_TRANSITIONS,
                JobState.NEW,
                TERMINAL_JOB_STATES,
            )
        )
    chunks = []
    for title, table, start, terminal in tables:
        lines = []
        if mermaid:
            lines += ["stateDiagram-v2", f"  %% {title}", f"  [*] --> {start.name}"]
            for source, edges in table.items():
                targets: dict[str, list[str]] = {}
                for tag, target in edges.items():
                    targets.setdefault(target.name, []).append(tag)
                for target_name, tags in targets.items():
                    lines.append(f"  {source.name} --> {target_name}: {', '.join(tags)}")
            lines += [f"  {end.name} --> [*]" for end in terminal]
        else:
            lines.append(title)
            for source, edges in table.items():
                for tag, target in edges.items():
                    lines.append(f"  {source.name} --{tag}--> {target.name}")
        chunks.append("\n".join(lines))
    click.echo("\n\n".join(chunks))
