"""``specshim extract --data-parallel 1`` on the GPU: the one shard runs on
the one GPU and writes what a plain run writes. (N > 1 needs a host with more
GPUs than the lent one; the CPU tier runs N = 2.)"""

from __future__ import annotations

from specshim.job.parallel import visible_gpus

from ..e2e.test_extract_parallel import same_as_one_run


def test_data_parallel_one_writes_what_a_plain_run_writes(tmp_path, tiny_model_dir):
    """One shard on the one GPU: the child sees CUDA_VISIBLE_DEVICES=<that
    GPU> and ``--shard 0/1``; its files, manifest and data_config.json must be
    bit-identical to a plain run's (each sample generated alone in both)."""
    _, one = same_as_one_run(tmp_path, tiny_model_dir("llama"), 1)
    header = (one / ".specshim" / "shard-0-of-1.log").read_text().splitlines()[0]
    first = visible_gpus()[0]  # what a shard of one on a host of one is given
    assert header.startswith(f"# CUDA_VISIBLE_DEVICES={first} "), header
