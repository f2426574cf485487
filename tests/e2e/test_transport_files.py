"""``extract``'s files through the hand-over are bit for bit those of the
path it replaced (``SPECSHIM_DISABLE=state-transport``: the states pickled
through vLLM's RPC queue, as speculators 0.3.0 sends them), on Llama at
TP=1 and TP=2 and on DeepSeek-V3. Extended: six extract runs; the generate()
level comparison (``test_states_are_bit_identical_through_every_transport``)
runs in CI."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from .checks import assert_same_files
from .test_extract import _command, _files

pytestmark = pytest.mark.extended


@pytest.mark.parametrize(
    ("name", "tp"), [("llama", 1), ("llama", 2), ("deepseek_v3", 1)]
)
def test_extracts_files_are_those_of_the_pickled_path(
    tmp_path, tiny_model_dir, name, tp
):
    rng = random.Random(46)
    prefix = [rng.randrange(300) for _ in range(40)]
    rows = [prefix + [rng.randrange(300) for _ in range(rng.randrange(1, 200))]]
    rows += [
        [rng.randrange(300) for _ in range(rng.choice([30, 300, 700]))]
        for _ in range(9)
    ]
    rows += [rows[1], rows[0]]  # duplicates
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    model = tiny_model_dir(name)
    for mode, disable in (("shared", None), ("pickled", "state-transport")):
        env = {k: v for k, v in os.environ.items() if k != "SPECSHIM_DISABLE"}
        if disable:
            env["SPECSHIM_DISABLE"] = disable
        if tp > 1:  # vLLM's CPU workers bind one core each
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
        run = subprocess.run(
            _command(
                model, data, tmp_path / mode, "--tp", str(tp), "--batch-size", "4"
            ),
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        applied = [
            line
            for line in run.stderr.splitlines()
            if "patch(es) to speculators.data_generation.custom_worker" in line
        ]
        assert applied, run.stderr[-3000:]
        # each path is the one named: the hand-over, or speculators' pickling
        assert all(("state-transport" in line) == (not disable) for line in applied)
    assert_same_files(
        _files(tmp_path / "shared"), _files(tmp_path / "pickled"), len(rows)
    )
