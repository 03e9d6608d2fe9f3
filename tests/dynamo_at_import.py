"""A module that imports ``torch._dynamo`` at import time (tests/test_import_graph.py's probe must name it)."""
import torch._dynamo  # noqa: F401
