"""What ``--out`` holds, and where each thing in it goes: extract's writer
and its shard logs write at the paths the store gives them.

Rooms:

* ``store``: the directory (one run at a time), its samples and their
  files; settling what a killed run left behind.
* ``manifest``: the record of which files are whole, with their sizes and
  checksums; a file counts only once the manifest describes it.
* ``manifest_room``: a run's manifest as it writes it, lines laid into
  zero-filled room so that making them durable waits for nothing else.
* ``data_config``: ``data_config.json``, the settings the samples were
  extracted with, published once and checked by every later run.
"""
