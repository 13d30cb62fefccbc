"""Small helpers shared across aitoolbox: dict reshaping, file-system chores and function introspection."""
