"""The ``kvflow`` command: ``main`` (the click group) and one module per verb, which only
renders what the analysis rooms compute. ``common`` holds what every verb shares.

May import: anything. Nothing imports ``kvflow.cli`` (``tests/test_layout.py``).
"""
