"""The shipped run configs (YAML), found by name through importlib.resources."""
