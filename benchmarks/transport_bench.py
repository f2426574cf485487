"""Captured states from a worker process to the main one, both ways: the CPU
proxy of ``state-transport``.

A spawned worker holds one call's states (3 layers of bfloat16 rows, split
into steps as the capture stores them) and answers each request the way a
vLLM worker answers ``_get_captured_states``:

* ``pickled``: the tensors pickled whole (speculators' path: torch pickles a
  tensor's storage inline), the bytes through a pipe, ``pickle.loads`` here;
* ``shared``: specshim's ``state_transport.send`` into the worker's shared
  region, its small descriptors through the same pipe, views mapped here.

Either way the main process then does what speculators does with the reply:
a ``clone()`` of every sequence's rows of every layer (a copy into fresh
memory for the pickled tensors; for the shared ones, the slab's rows handed
over). MiB/s counts the states' bytes from the request to the last clone;
every transfer is checked bit for bit against the worker's rows. Writes
``benchmarks/results/transport.json``.

Usage: .venv/bin/python benchmarks/transport_bench.py [--mb 96] [--repeats 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = 2048
LAYERS = 3
SEQUENCE = 900  # rows per sequence, as speculators slices them
STEP = 8192  # rows per stored step


def _states(rows: int, seed: int) -> list[list[Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        whole = torch.randn(rows, HIDDEN, generator=generator).to(torch.bfloat16)
        layers.append(list(whole.split(STEP)))
    return layers


def _worker(conn: Any, rows: int) -> None:
    from specshim.patches.worker import state_transport

    class Worker:
        _specshim_region = None

    worker = Worker()
    captured = _states(rows, seed=0)
    pieces = [(f, 0, t.shape[0]) for f, t in enumerate(captured[0])]
    while True:
        mode = conn.recv()
        if mode is None:
            if worker._specshim_region is not None:
                worker._specshim_region.close()
            return
        if mode == "pickled":
            import torch

            reply: Any = [torch.cat(layer) for layer in captured]
        else:
            reply = state_transport.send(worker, captured, pieces)
        conn.send_bytes(pickle.dumps(reply, protocol=5))


def _consume(layers: list[Any], rows: int) -> list[list[Any]]:
    """speculators' slicing: every sequence's rows of every layer, cloned."""
    return [
        [h[start : start + SEQUENCE].clone() for h in layers]
        for start in range(0, rows, SEQUENCE)
    ]


def measure(mb: int, repeats: int) -> dict[str, Any]:
    """MiB/s of each transport, after checking both deliver the worker's rows."""
    import torch

    rows = max(1, (mb << 20) // (LAYERS * HIDDEN * 2))
    want = [torch.cat(layer) for layer in _states(rows, seed=0)]
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_worker, args=(there, rows), daemon=True)
    process.start()
    found: dict[str, Any] = {"mib": round(rows * LAYERS * HIDDEN * 2 / 2**20, 1)}
    try:
        for mode in ("pickled", "shared"):
            here.send(mode)  # a first round trip: start-up and region growth
            _check(pickle.loads(_reply(here, process)), want, mode)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                here.send(mode)
                got = _consume(pickle.loads(_reply(here, process)), rows)
                seconds.append(time.perf_counter() - start)
                del got
            best = min(seconds)
            found[f"{mode}_mib_per_s"] = round(found["mib"] / best, 1)
            found[f"{mode}_seconds"] = [round(s, 4) for s in seconds]
    finally:
        here.send(None)
        process.join(30)
    found["speedup"] = round(found["shared_mib_per_s"] / found["pickled_mib_per_s"], 2)
    return found


def _reply(conn: Any, process: Any) -> bytes:
    """The worker's next reply; an error, not a hang, if the worker died."""
    while not conn.poll(1.0):
        if not process.is_alive():
            raise RuntimeError(f"the worker process exited ({process.exitcode})")
    return conn.recv_bytes()


def _check(layers: list[Any], want: list[Any], mode: str) -> None:
    import torch

    for index, (have, expected) in enumerate(zip(layers, want, strict=True)):
        if have.dtype != expected.dtype or not torch.equal(
            have.view(torch.uint8), expected.view(torch.uint8)
        ):
            raise AssertionError(f"{mode}: layer #{index} differs from the worker's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=96, help="states per call, MiB")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    found = measure(args.mb, args.repeats)
    found.update(host=platform.machine(), cores=multiprocessing.cpu_count())
    print(
        f"transport: {found['mib']} MiB a call; pickled {found['pickled_mib_per_s']} "
        f"MiB/s, shared {found['shared_mib_per_s']} MiB/s ({found['speedup']}x)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transport.json").write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
