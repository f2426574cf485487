"""Loaded by Python at start-up in processes started through ``specshim run``.

``specshim run`` puts this directory first on PYTHONPATH, so every Python
process it starts (and their Python children, which inherit the variable)
imports specshim before any user code. Another ``sitecustomize`` further down
the path is still run afterwards.
"""

import importlib.machinery
import importlib.util
import os
import sys

import specshim  # noqa: F401  (arms the patches)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
