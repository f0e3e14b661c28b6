"""The model-based conservation test: the standing guard for money (issue 20)."""
