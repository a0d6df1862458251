"""Trace files (DESIGN §5): the format and record chain (``format``), the writer, the streaming
reader, and what the reader checks in each line (``problems``: decode errors; ``ranges``:
integers a live engine could have recorded)."""
