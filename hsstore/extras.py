"""Optional dependencies: which install extra provides each, and the error a missing one gives.

``pip install hsstore`` is the store library alone (numpy, pyarrow, zarr, fsspec, pydantic,
pandas). Reading features as torch tensors, running the jobs, ``s3://`` stores and plots need a
module that an extra adds (pyproject.toml's ``[project.optional-dependencies]``, which this table
mirrors). Code that imports one of them lazily goes through :func:`import_optional`, so that a
missing module says which extra to install instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hsstore.errors import MissingDependencyError

# Top-level module -> the smallest extra that installs it.
EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "train",
    "transformers": "train",
    "safetensors": "train",
    "tqdm": "train",
    "ray": "extract",
    "s3fs": "s3",
    "obstore": "s3",
    "botocore": "s3",
    "matplotlib": "all",
    "datasets": "all",
}


def install_hint(module: str, extra: str | None = None) -> str:
    """``pip install 'hsstore[EXTRA]'`` for ``module`` (``[all]`` when it is not one of ours)."""
    extra = extra or EXTRA_OF_MODULE.get(module.partition(".")[0], "all")
    return f"pip install 'hsstore[{extra}]'"


def missing_dependency(module: str, purpose: str, extra: str | None = None) -> MissingDependencyError:
    """The error for ``purpose`` needing ``module``, which this install lacks."""
    return MissingDependencyError(
        f"{purpose} needs {module.partition('.')[0]}, which the base install (pip install hsstore) "
        f"leaves out; install it with: {install_hint(module, extra)}"
    )


def import_optional(module: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingDependencyError` naming the extra to install.

    Only a missing ``module`` itself is translated; an import error inside it is re-raised as is.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or module.partition(".")[0] != err.name.partition(".")[0]:
            raise
        raise missing_dependency(module, purpose) from err
