"""kvpilot: a paged-attention LLM inference engine and the Kubernetes operator that tunes it.

The repository's rooms install as subpackages (``engine/`` -> ``kvpilot.engine``, ``kernels/`` ->
``kvpilot.kernels``, ``operator/`` -> ``kvpilot.operator``). ``operator/`` has no ``__init__.py`` on
purpose: a folder named ``operator`` holding one would shadow the standard library's ``operator``
module for any Python started in the repository root, so ``kvpilot.operator`` is a namespace package.
"""

import os as _os

__version__ = "0.1.0"


def _source_checkout_root() -> str | None:
    """The repository root when this package is imported from a source checkout, else None."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    marker = _os.path.join(root, "operator", "api", "__init__.py")
    if _os.path.isfile(_os.path.join(root, "pyproject.toml")) and _os.path.isfile(marker):
        return root
    return None


# From a wheel, kvpilot/operator/ sits inside this package and needs nothing. From a source checkout
# (an editable install, or Python started in the repository root) the rooms are siblings of this folder;
# setuptools' editable finder cannot resolve a namespace package mapped under a regular one, so the
# root joins this package's search path: kvpilot.operator then resolves to ./operator, kvpilot.engine
# and kvpilot.kernels to the same folders the editable mapping names.
_root = _source_checkout_root()
if _root is not None and _root not in __path__:
    __path__.append(_root)
del _root
