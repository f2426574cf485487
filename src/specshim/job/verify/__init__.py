"""``specshim verify``: stored samples recomputed and judged.

Rooms:

* ``command``: the command: which samples, recomputed how, judged by the bar.
* ``modes``: the two ways to recompute (``hf``: a Hugging Face forward,
  sized before loading; ``solo``: the generator, one sample at a time) and
  which one a run gets.
* ``hf_reference``: the Hugging Face forward with hooks, and the agreement
  bar (per-token cosine and norm ratio) every comparison uses.
"""
