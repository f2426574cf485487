"""The hand-over: how a call's captured states leave the workers and become
the caller's, in one place.

Rooms:

* ``slab``: a slab's header words and file names, shared by both sides.
* ``shared_states``: the worker's side. Its slabs of shared, pinned host
  memory in ``/dev/shm`` (which one a call may write, and when), the
  descriptor that maps one in the main process, and the fallback (rows as
  numpy, copied on arrival) where no slab can be had.
* ``host_slabs``: one slab, and the thread that makes them beside the GPU's
  work or vLLM's start-up (``prepared-slabs``).
* ``early_copies``: the worker's copies of a call's layers into its slab,
  made as each layer is captured, used where they are exactly what the fetch
  would write.
* ``handed_states``: the main process's side. A descriptor mapped into the
  call's layers, the lease that gives a slab back once the caller lets go of
  every tensor over it, and the clones handed their own rows.
* ``private_copy``: a shared mapping turned into the process's own memory
  where it stands (``handed_states`` does it to held slabs at a fork).
* ``rows``: which captured rows are which sequence's (from the tokens and
  positions the forward recorded), used to lay them out in input order in
  the worker and to prove them in the main process.
* ``prefix_rows``: with prefix caching on, each sequence's served rows put
  back in front of its tail, from the same call or the store of
  ``specshim._prefix_reuse`` (``generate-guard``); for ``extract``'s store,
  as the pieces they lie in (``specshim._joined``), not joined.
* ``row_arena``: the main process's memory those joined rows go into, kept
  mapped and written again only once the caller lets go of every tensor
  over it (the slabs' rule, for memory no worker sees).
* ``threads``: the main process's copies on more than one core, where the
  states are copied after all.

The patches that use it: ``worker/state_transport.py`` (the worker's reply),
``worker/prepared_slabs.py`` (slabs made before the first call) and
``main/generate_guard.py`` (the proof). Who owns what and when:
``shared_states``' docstring, and ../shared/design/state-transport.md.
"""
