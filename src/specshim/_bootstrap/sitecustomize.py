"""Loaded by Python at start-up in processes started through ``specshim run``.

``specshim run`` puts this directory first on PYTHONPATH, so every Python
process it starts (and their Python children, which inherit the variable)
imports specshim before any user code. Another ``sitecustomize`` further down
the path is still run afterwards.

A Python that cannot import specshim (another environment's interpreter found
first on PATH, say) must not run the program unpatched: it exits with status
1 and says which interpreter it is and how to fix it.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import specshim  # noqa: F401  (arms the patches)
except Exception as exc:  # noqa: BLE001 - any failure means "not patched"
    sys.stderr.write(
        f"specshim run: error: {sys.executable} cannot import specshim ({exc!r}), "
        "so it would run the program without the patches. Run the program with "
        f"the Python that has specshim ({os.environ.get('SPECSHIM_RUN_PYTHON', '?')}"
        "), or install specshim into this one.\n"
    )
    sys.stderr.flush()
    os._exit(1)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
