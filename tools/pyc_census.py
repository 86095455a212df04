"""How many of each package's modules have bytecode beside them (what imports on the lent machine
cost: it sets PYTHONDONTWRITEBYTECODE=1, so a module without bytecode is compiled at every import)."""

import importlib.util
import os
import sys
from pathlib import Path

for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        print(f"{name}: not installed")
        continue
    root = Path(spec.origin).parent
    sources = sum(1 for _ in root.rglob("*.py"))
    compiled = sum(1 for _ in root.rglob("*.pyc"))
    print(f"{name}: {root} {sources} .py, {compiled} .pyc, writable={os.access(root, os.W_OK)}")
