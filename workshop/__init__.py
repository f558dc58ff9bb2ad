"""The workshop server: JupyterHub for a room of learners (docs/workshop.md)."""
