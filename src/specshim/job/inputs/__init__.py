"""What a job reads before it runs.

Rooms:

* ``checkpoint``: the model directory (its config, text stack and layers).
* ``dataset``: the samples, in every format accepted, and sharding.
* ``tokenizing``: conversations to token ids and loss masks.
* ``tiny_checkpoints``: the tiny random-weight models ``demo`` and the tests
  build instead of downloading one.
"""
