"""``specshim export``: a verified ``--out`` into the layout a trainer reads.

Rooms:

* ``command``: the command (what is exported, checked, and how).
* ``dest``: the destination directory, written whole or not at all.
"""
