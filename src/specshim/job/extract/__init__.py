"""``specshim extract``: dataset in, speculators' training files out.

Rooms:

* ``command``: the command itself: opens ``--out``, starts the generator,
  feeds it and hands each batch to the writer.
* ``timing``: its closing lines, where the run's time went.
* ``options``: what the command line asks for (``ExtractOptions``).
* ``plan``: the options checked against the model and the host, frozen into
  a ``RunPlan`` (step budget, layers, tensor parallelism, KV cache).
* ``feed``: the samples still to do, in batches, resumed where ``--out``
  stops.
* ``writer``: each batch's files, written on threads and committed to the
  manifest in order.
* ``committer``: the writer's commits on a thread of their own, one fsync of
  the manifest for all the batches waiting, then their renames.
* ``torch_file``: ``torch.save``'s bytes, written with the GIL free for the
  main thread (the first file of each shape checked against torch.save).
* ``startup``: progress lines while vLLM starts.
* ``prefixes``: which samples share full KV blocks, the order that runs them
  together and the rows their reuse holds.
* ``reuse``: ``--reuse-prefixes``: the feed in the plan's order, the
  generator's store of prefix rows, what the cache served.
* ``parallel`` and ``shard_host``: ``--data-parallel N``, one shard per GPU
  slot on one host, their lives tied to the command's.
"""
