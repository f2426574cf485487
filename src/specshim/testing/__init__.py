"""Tiny random-weight checkpoints and a Hugging Face reference, for tests and the demo."""
