"""The job: specshim's data pipeline, built on the shim.

``specshim extract`` reads a dataset (``dataset``), decides per sample what
``--out`` already holds (``store``, ``feed``), generates with the unmodified
speculators generator and writes speculators' training files (``extract``,
``writer``); ``status`` and ``verify`` read them back, ``verify`` recomputes
samples (``references``) and judges them with the agreement bar
(``agreement``); ``demo`` runs all of it on a tiny model it builds.

The shim (``import specshim``: registry, hooks, settings, patches) never
imports this package; the command line sits on top of both.
"""
