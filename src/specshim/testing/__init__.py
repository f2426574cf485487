"""Tiny random-weight checkpoints and a Hugging Face reference (tests, demo)."""
