"""Task data: the embedded default task set and loading task files."""
