"""Remote-code files copied into the tiny Kimi-K2.5 checkpoint (``auto_map``)."""
