"""``make bench-writer``: extract's writer alone, against a plain write.

From states already in memory (random bfloat16, one tensor of its own per
layer and sample, as ``generate()`` hands them over), on one disk:

* ``plain``: the same bytes, one file per sample, written in one thread with
  ``open``/``write``/``close``: what the disk takes without any format.
* ``writer``: ``specshim.job.extract.writer.Writer`` itself, as ``extract`` drives it:
  batches put one at a time, ``prepare_sample`` on its pool, the manifest
  fsynced by its committer (once for the batches waiting), every file renamed
  into place. The files are the ones
  ``extract`` writes (tests/unit/test_writer_bench.py compares them byte for
  byte).
* ``writer, busy main thread``: the same, while another Python thread loops
  as vLLM's reply wait does in ``extract``'s main process (``sched_yield``
  between checks of a flag): it holds the GIL most of the time, which the
  pool's threads need between their system calls.

And the other way round: a thread that needs the GIL all the time (as
``extract``'s main thread does between vLLM's steps) counts beside the
writer, and its rate over its rate alone is the share of the GIL the writer
leaves it, with the files written by ``torch_file`` and by ``torch.save``.

Each is timed from the first byte to the last file renamed (or closed), into
the page cache (no fsync of the data files: a file is done when the manifest
describes it, see docs/output.md). GB/s counts the states' bytes only.
Usage:

    python3 benchmarks/writer_bench.py [--hidden 2048 --layers 3 --samples 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH = 32


def samples(
    count: int,
    hidden: int,
    layers: int,
    seed: int = 0,
    vocab: int = 32000,
    lengths: tuple[int, int] = (256, 1535),
) -> list[Any]:
    """(Todo, result) pairs of ``count`` samples of 256 to 1,535 tokens."""
    import torch

    from specshim.job.extract.feed import Todo

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # Rows drawn once and copied per sample: drawing tens of GB with one
    # generator takes minutes, copying them seconds; the disk sees as many
    # bytes either way.
    pool = torch.randn(2 * lengths[1], hidden, generator=gen).to(torch.bfloat16)
    pairs = []
    for index in range(count):
        tokens = rng.randint(*lengths)
        ids = [rng.randrange(vocab // 2, vocab) for _ in range(tokens)]
        todo = Todo(
            index=index,
            where=f"bench:{index}",
            record=f"r{index}",
            tokens=f"t{index}",
            input_ids=array("i", ids),
            loss_mask=array("b", [1] * tokens),
        )
        states = []
        for _ in range(layers):
            start = rng.randrange(len(pool) - tokens + 1)
            states.append(pool[start : start + tokens].clone())
        result = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "hidden_states": states,
            "loss_mask": None,
        }
        pairs.append((todo, result))
    return pairs


def state_bytes(pairs: list[Any]) -> int:
    return sum(
        h.numel() * h.element_size() for _, r in pairs for h in r["hidden_states"]
    )


def write_plain(pairs: list[Any], where: Path) -> float:
    """Seconds to write each sample's state bytes to a file of its own."""
    where.mkdir(parents=True, exist_ok=True)
    views = [
        [h.view(-1).view(_uint8()).numpy() for h in r["hidden_states"]]
        for _, r in pairs
    ]
    start = time.perf_counter()
    for (todo, _), parts in zip(pairs, views, strict=True):
        with open(where / f"plain_{todo.index}", "wb") as handle:
            for part in parts:
                handle.write(part)
    return time.perf_counter() - start


def _uint8() -> Any:
    import torch

    return torch.uint8


def write_with_writer(
    pairs: list[Any], out: Path, busy: bool = False, commits: Any = None
) -> float:
    """Seconds for extract's writer to write and commit every sample into
    ``out`` (a fresh output directory), the main thread only handing batches
    over; ``busy``: while a thread spins on the GIL as vLLM's reply wait does.
    ``commits`` (a list) gets the committer's seconds and its syncs of the
    manifest: what making the lines durable cost while the files were written."""
    from specshim.job.extract.writer import Progress, Writer
    from specshim.job.outdir import store

    store.prepare_out(out)
    run = store.Run(out, {"shard": [0, 1]})
    run.start()
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
    try:
        if busy:
            spinner.start()
        start = time.perf_counter()
        writer = Writer(run, Progress(False))
        for first in range(0, len(pairs), BATCH):
            chunk = pairs[first : first + BATCH]
            writer.put([t for t, _ in chunk], [r for _, r in chunk])
        writer.finish()
        seconds = time.perf_counter() - start
    finally:
        stop.set()
        if busy:
            spinner.join()
        run.close()
    if writer.written != len(pairs):
        raise RuntimeError(f"the writer wrote {writer.written} of {len(pairs)}")
    if commits is not None:
        commits.append((seconds, round(writer.committing, 3), writer.syncs))
    return seconds


def _spin(stop: threading.Event) -> None:
    """vLLM's ``MessageQueue.acquire_read`` while a step runs: check a flag,
    ``sched_yield``, again (shm_broadcast.py, the busy-loop phase)."""
    flags = bytearray(8)
    while not stop.is_set():
        for _ in range(64):
            if flags[0]:
                break
            os.sched_yield()


def _count(stop: threading.Event, counted: list[float]) -> None:
    """Python work that needs the GIL all the time, as extract's main thread
    does between vLLM's steps (scheduling, taking replies): its rate."""
    began, k = time.perf_counter(), 0
    while not stop.is_set():
        k += 1
    counted.append(k / (time.perf_counter() - began))


def main_thread_share(pairs: list[Any], out: Path, torch_save: bool) -> float:
    """The rate a GIL-bound thread keeps while extract's writer writes every
    sample, over its rate alone: 1.0 is a writer that leaves the GIL free.
    ``torch_save``: the files through torch.save itself, as before
    ``torch_file``."""
    from specshim.job.extract import torch_file

    def rate(work: Any) -> float:
        stop, counted = threading.Event(), []
        thread = threading.Thread(target=_count, args=(stop, counted))
        thread.start()
        try:
            work()
        finally:
            stop.set()
            thread.join()
        return counted[0]

    saved = list(torch_file._FALLBACK)
    if torch_save:
        torch_file._FALLBACK[:] = ["bench-writer: torch.save"]
    try:
        beside = rate(lambda: write_with_writer(pairs, out))
    finally:
        torch_file._FALLBACK[:] = saved
    shutil.rmtree(out, ignore_errors=True)
    alone = rate(lambda: time.sleep(0.5))
    return beside / alone


def page_cache(proc: Path = Path("/proc")) -> dict[str, int]:
    """What bounds a write into the page cache on this host: its memory, and
    the kernel's dirty-page limits (writers are throttled towards the disk's
    speed once dirty pages pass about the midpoint of the background and the
    hard limit; a ``_bytes`` setting, where nonzero, replaces its ratio).
    A figure the host does not show is left out."""
    found: dict[str, int] = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("MemTotal", "MemAvailable", "Dirty"):
                found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for name in (
        "dirty_ratio",
        "dirty_background_ratio",
        "dirty_bytes",
        "dirty_background_bytes",
    ):
        try:
            found[name] = int((proc / "sys" / "vm" / name).read_text())
        except (OSError, ValueError):
            pass
    return found


def throttle_bytes(cache: dict[str, int]) -> int | None:
    """Dirty bytes past which the kernel starts slowing writers (the midpoint
    of the background and the hard limit, of available memory); None where
    the host's figures are missing."""
    available = cache.get("MemAvailable")
    if available is None or "dirty_ratio" not in cache:
        return None
    hard = cache.get("dirty_bytes") or available * cache["dirty_ratio"] // 100
    background = cache.get("dirty_background_bytes") or (
        available * cache.get("dirty_background_ratio", 0) // 100
    )
    return (hard + background) // 2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from specshim.job.extract.writer import writers

    pairs = samples(args.samples, args.hidden, args.layers)
    nbytes = state_bytes(pairs)
    found: dict[str, Any] = {
        "hidden": args.hidden,
        "layers": args.layers,
        "samples": args.samples,
        "state_bytes": nbytes,
        "threads": writers(),
        "cpus": os.cpu_count(),
        "dir": str(args.dir),
        "passes": args.passes,
        "page_cache": page_cache(),
    }
    commits: list[Any] = []
    runs = {
        "plain": lambda d: write_plain(pairs, d),
        "writer": lambda d: write_with_writer(pairs, d, commits=commits),
        "writer, busy main thread": lambda d: write_with_writer(pairs, d, busy=True),
    }
    if args.brief:
        del runs["writer, busy main thread"]
    for label, run in runs.items():
        best = None
        for _ in range(args.passes):
            where = args.dir / "run"
            shutil.rmtree(where, ignore_errors=True)
            seconds = run(where)
            best = seconds if best is None else min(best, seconds)
            shutil.rmtree(where, ignore_errors=True)
        found[label] = round(nbytes / best / 1e9, 3)
        print(f"{label}: {found[label]} GB/s", flush=True)
    for label in list(runs)[1:]:
        found[f"{label} / plain"] = round(found[label] / found["plain"], 3)
    _, found["commit_seconds"], found["commit_syncs"] = min(commits)
    shares = () if args.brief else (("torch_file", False), ("torch.save", True))
    for label, torch_save in shares:
        best = max(
            main_thread_share(pairs, args.dir / "run", torch_save)
            for _ in range(args.passes)
        )
        found[f"main thread's share, {label}"] = round(best, 3)
        print(f"a GIL-bound main thread's rate beside it, {label}: {best:.3f} of idle")
    return found


def render(found: dict[str, Any]) -> str:
    labels = [k.removesuffix(" / plain") for k in found if k.endswith(" / plain")]
    rows = "\n".join(
        f"| {label} | {found[label]} | {found[label + ' / plain']} |"
        for label in labels
    )
    return (
        f"## {found['layers']} layers x {found['hidden']}\n\n"
        f"{found['samples']} samples of {found['layers']} layers x "
        f"{found['hidden']} (bfloat16, 256 to 1,535 tokens), "
        f"{found['state_bytes'] / 1e9:.2f} GB of states, into {found['dir']} "
        f"(page cache, no fsync of the data files); the writer's pool had "
        f"{found['threads']} threads on {found['cpus']} CPUs; best of "
        f"{found['passes']} passes.\n\n"
        f"Plain write of the same bytes, one thread: {found['plain']} GB/s.\n\n"
        + _page_cache(found)
        + _shares(found)
        + _commits(found)
        + "| extract's writer | GB/s | ÷ plain |\n|---|---:|---:|\n"
        f"{rows}\n\n"
        f"Host: {found.get('host', 'unknown')}; {found.get('date', '')}.\n"
    )


def _page_cache(found: dict[str, Any]) -> str:
    """Whether the states outgrew what the host's page cache takes unthrottled
    (results from before it have no such line)."""
    cache = found.get("page_cache") or {}
    limit = throttle_bytes(cache)
    if limit is None:
        return ""
    over = "over" if found["state_bytes"] > limit else "under"
    return (
        f"The host had {cache['MemAvailable'] / 2**30:.0f} GiB available; "
        f"writers are throttled from about {limit / 1e9:.1f} GB of dirty pages "
        f"(vm.dirty_ratio {cache['dirty_ratio']}, dirty_background_ratio "
        f"{cache.get('dirty_background_ratio', '?')}): these states were "
        f"{over} that.\n\n"
    )


def _commits(found: dict[str, Any]) -> str:
    """The writer's commits in its best pass (results from before have none)."""
    if "commit_syncs" not in found:
        return ""
    return (
        f"In the writer's best pass its committer made the manifest's lines "
        f"durable {found['commit_syncs']} times, in {found['commit_seconds']} "
        "s with the renames, beside the files being written.\n\n"
    )


def _shares(found: dict[str, Any]) -> str:
    """The main thread's share line (results from before it have none)."""
    ours = found.get("main thread's share, torch_file")
    theirs = found.get("main thread's share, torch.save")
    if ours is None or theirs is None:
        return ""
    return (
        "A thread that needs the GIL all the time (extract's main thread "
        "between vLLM's steps) keeps "
        f"{ours} of its idle rate while the writer writes (torch_file), "
        f"{theirs} when the files go through torch.save.\n\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/specshim-bench-writer"))
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--label", default="", help="names the host in the results")
    parser.add_argument(
        "--brief",
        action="store_true",
        help="the plain write and the writer only: for states the size of a "
        "GPU run's (tens of GB), where each write costs a device minute",
    )
    args = parser.parse_args()
    found = measure(args)
    found["host"] = args.label or os.uname().nodename
    found["date"] = time.strftime("%Y-%m-%d")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "writer.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[f"{found['layers']} x {found['hidden']}"] = found  # by shape
    path.write_text(json.dumps(merged, indent=2) + "\n")
    (args.results / "writer.md").write_text(
        "# make bench-writer\n\n" + "\n".join(map(render, merged.values()))
    )
    print(render(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
