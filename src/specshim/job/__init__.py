"""The job: specshim's data pipeline, built on the shim.

Rooms:

* ``extract``: ``specshim extract``, dataset in, speculators' training files
  out (its plan, feed, writer and ``--data-parallel``).
* ``outdir``: what ``--out`` holds: the store, the manifest, data_config.json.
* ``inputs``: what a run reads: the checkpoint, the dataset, tokenization,
  and the tiny checkpoints the demo and the tests build.
* ``verify``: ``specshim verify``, samples recomputed (a Hugging Face forward
  or the generator alone) and judged against the agreement bar.
* ``export``: ``specshim export``, a finished output in today's trainers'
  layout.
* ``status``: ``specshim status``, how far an output has got, from its
  manifests alone.
* ``demo``: all of it on a tiny model it builds.
* ``kv_cache``: the KV cache a run needs, and vLLM's CPU cache space for it.

The shim (``import specshim``: registry, hooks, settings, patches) never
imports this package; the command line sits on top of both.
"""
