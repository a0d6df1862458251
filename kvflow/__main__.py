"""``python -m kvflow``: the kvflow command."""

from kvflow.cli import main

main()
