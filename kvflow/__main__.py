"""``python -m kvflow``: the kvflow command."""

from kvflow.cli.main import main

main()
