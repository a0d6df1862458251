"""Trace files (DESIGN §5): the format and record chain (``format``), the writer, the streaming
reader and the bytes it reads (``source``: plain, or gzip up to the damage), and what the reader
checks in each line (``problems``: decode errors; ``ranges``: integers a live engine could have
recorded)."""
