"""``specshim extract --data-parallel N``: one command that fills a host.

It starts N ``specshim extract ... --shard I/N`` runs as child processes, the
very path a hand-made shard takes, so the output directory, its manifest and
its resume rules are the same. Shard i sees only GPUs ``i*T .. i*T+T-1`` of
those visible (T = ``--tp``); on a host without an NVIDIA GPU each runs vLLM's
CPU backend with vLLM's own thread binding. Each child logs to
``OUT/.specshim/shard-I-of-N.log``; this process reads the children's manifests
for one progress line and gives one exit status.

A child that fails stops the others with SIGINT, as Ctrl-C stops a single run:
the batches already generated are written, and every file under its final name
is whole (``specshim.job.extract.writer``), so a rerun of the same command resumes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from specshim._base import InterruptedRunError, SpecShimError, UsageError
from specshim.job import kv_cache
from specshim.job.extract.shard_host import (
    die_with_parent,
    failure,
    refuse_beyond_the_host,
    skipped,
)
from specshim.job.outdir import store as _store
from specshim.job.outdir.manifest import Entry, parse_line

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
LOG_EVERY = 30.0  # seconds between progress lines when stderr is no terminal
BAR_EVERY = 2.0  # and on a terminal


@dataclass(frozen=True)
class Slot:
    """One child: its shard of the dataset and the GPUs it may see."""

    shard: tuple[int, int]
    gpus: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES; None: the CPU backend

    @property
    def name(self) -> str:
        return f"{self.shard[0]}/{self.shard[1]}"

    def log(self, out: Path) -> Path:
        return out / _store.META / f"shard-{self.shard[0]}-of-{self.shard[1]}.log"


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The NVIDIA GPUs this process may use; None on a host without any.

    ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it: its entries up to the
    first invalid one (``-1`` hides every GPU).
    """
    count = _nvidia_gpus()
    if count is None:
        return None
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return [str(i) for i in range(count)]
    found = []
    for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        found.append(entry)
    return found


def _nvidia_gpus() -> int | None:
    """How many GPUs ``nvidia-smi -L`` lists; None where there is no driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listed = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    count = sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))
    return count if listed.returncode == 0 and count else None


def plan_slots(
    count: int,
    tp: int,
    host_shard: tuple[int, int] | None,
    gpus: list[str] | None,
) -> list[Slot]:
    """The children of ``--data-parallel count``, or a one-line UsageError.

    ``host_shard`` is this host's share from ``--shard auto`` (None without):
    child i of host h of H takes shard ``h + H*i`` of ``H*count``, so the
    children of all hosts together take every sample once.
    """
    if count < 1:
        raise UsageError(f"--data-parallel {count}: give at least 1")
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    if gpus is not None and count * tp > len(gpus):
        raise UsageError(
            f"--data-parallel {count} x --tp {tp} needs {count * tp} GPUs; "
            f"{len(gpus)} visible (CUDA_VISIBLE_DEVICES="
            f"{','.join(gpus) or 'none'})"
        )
    refuse_beyond_the_host(count, tp, gpus)
    host, hosts = host_shard or (0, 1)
    return [
        Slot(
            (host + hosts * i, hosts * count),
            None if gpus is None else tuple(gpus[i * tp : (i + 1) * tp]),
        )
        for i in range(count)
    ]


@dataclass
class _Child:
    slot: Slot
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float
    state: str = "starting"
    samples: int = 0
    tokens: int = 0
    first: float | None = None  # when its first file was recorded
    _manifest: Path | None = None
    _offset: int = 0
    _rest: bytes = b""

    def read_manifest(self, out: Path) -> None:
        """Count the entries this child's run has added to its manifest since
        the last call (its run id carries its process id)."""
        if self._manifest is None:
            # Run ids are host-pid-random (store.Run); the host as it names it.
            name = re.compile(
                rf"{re.escape(_store.Run(out).host)}-{self.process.pid}-[0-9a-f]+\.jsonl"
            )
            folder = out / _store.META / "manifest"
            mine = [p for p in folder.iterdir() if name.fullmatch(p.name)]
            mine = [p for p in mine if p.stat().st_mtime >= self.started - 1]
            if not mine:
                return
            self._manifest = mine[0]
        with contextlib.suppress(OSError), self._manifest.open("rb") as handle:
            handle.seek(self._offset)
            chunk = _up_to_zeros(handle)
            self._offset += len(chunk)
            *lines, self._rest = (self._rest + chunk).split(b"\n")
            for line in lines:
                self._count(line)

    def _count(self, line: bytes) -> None:
        entry, _ = parse_line(line.decode("utf-8", errors="replace"))
        if isinstance(entry, Entry):  # a header part, or a line not as written
            self.samples += 1
            self.tokens += entry.num_tokens
            self.first = self.first or time.time()
            if self.state == "starting":
                self.state = "running"


def _up_to_zeros(handle: IO[bytes], block: int = 1 << 16) -> bytes:
    """What a manifest holds from here to the room's zeros (``manifest_room``),
    where the child's next lines will go: read a block at a time, not the
    room's megabyte on every poll."""
    parts = []
    while chunk := handle.read(block):
        lines, zero, _ = chunk.partition(b"\0")
        parts.append(lines)
        if zero:
            break
    return b"".join(parts)


def _start(slot: Slot, argv: list[str], out: Path, runs: int = 1) -> _Child:
    """One child: ``specshim extract`` with ``argv`` and this slot's shard,
    one of ``runs`` on this host."""
    if slot.gpus is not None:
        own = {"CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)}
    else:  # the runs share the host's memory for their KV caches
        own = {kv_cache.SHARE: str(runs)}
    env = dict(os.environ, PYTHONUNBUFFERED="1", **own)
    command = [sys.executable, "-m", "specshim", *argv, "--shard", slot.name]
    # Appended to: a rerun keeps the log an earlier failure message named.
    log = slot.log(out).open("ab")
    log.write(f"# {_header(own, command)}\n".encode())
    log.flush()
    # Its own session: a Ctrl-C at the terminal reaches this process only,
    # which passes it on (``_signal``) to the child's whole process group.
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    return _Child(slot, process, log, time.time())


def _header(own: dict[str, str], command: list[str]) -> str:
    """The child's command as a shell would run it, its own variables first
    (its GPUs, or its share of a CPU host's memory)."""
    return " ".join([*(f"{k}={v}" for k, v in own.items()), *command])


def _signal(child: _Child, signum: int) -> None:
    """``signum`` to the child and what it started (vLLM workers, the feeder)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, signum)


@dataclass
class _Total:
    """The dataset's size and the samples done when the command began, found
    by a thread (``specshim status``'s count) while the children start."""

    left: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def count(self, out: Path, data: Path, dataset: dict[str, Any]) -> None:
        from specshim.job.status import collect

        try:
            status = collect(out, data, **dataset)
            self.left = None if status.total is None else status.total - status.done
        except Exception:  # noqa: BLE001 - an ETA is not worth a failure
            logger.debug("extract: could not count the dataset", exc_info=True)
        self.ready.set()


def run_parallel(
    slots: list[Slot], argv: list[str], out: Path, data: Path, dataset: dict[str, Any]
) -> dict[str, Any]:
    """Run one child per slot until all have ended; returns the counts
    ``specshim.cli.summary`` prints. Raises SpecShimError naming the first
    shard that failed, or saying the run was interrupted."""
    _store.prepare_out(out)
    total = _Total()
    threading.Thread(target=total.count, args=(out, data, dataset), daemon=True).start()
    children: list[_Child] = []
    try:
        for slot in slots:  # one by one: a failed start still stops the others
            try:
                children.append(_start(slot, argv, out, len(slots)))
            except OSError as exc:
                raise SpecShimError(
                    f"shard {slot.name} could not start: {exc.strerror or exc}; "
                    "the shards started were stopped"
                ) from None
        watch = _Watch(children, out, total)
        watch.run()
    finally:
        for child in children:
            if child.process.poll() is None:  # only if this process is failing
                _signal(child, signal.SIGKILL)
                child.process.wait()
            child.log.close()
    return watch.result()


class _Watch:
    """Polls the children: progress, the first failure, Ctrl-C."""

    def __init__(self, children: list[_Child], out: Path, total: _Total) -> None:
        self.children, self.out, self.total = children, out, total
        self.failed: _Child | None = None
        self.interrupts = 0
        self.stop_deadline: float | None = None
        self.bar = sys.stderr.isatty()
        self.shown = time.monotonic()
        self.began = time.time()

    def run(self) -> None:
        while any(child.process.poll() is None for child in self.children):
            try:
                self._tick()
                time.sleep(POLL_SECONDS)
            except KeyboardInterrupt:
                self._interrupt()
        self._tick()
        if self.bar:
            sys.stderr.write("\n")

    def _tick(self) -> None:
        for child in self.children:
            child.read_manifest(self.out)
            code = child.process.poll()
            if code is None or child.state in ("done", "failed", "stopped"):
                continue
            stopping = child.state in ("stopping", "killed")
            child.state = "done" if code == 0 else "stopped" if stopping else "failed"
            if child.state == "failed":
                _signal(child, signal.SIGKILL)  # what it left behind
                if self.failed is None:
                    self.failed = child
                    self._stop(signal.SIGINT)
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            self._stop(signal.SIGKILL)  # a shard that would not stop
        self._show()

    def _interrupt(self) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            logger.warning(
                "extract: stopping every shard after its current batch "
                "(Ctrl-C again stops them at once)"
            )
        self._stop(signal.SIGINT if self.interrupts == 1 else signal.SIGKILL)

    def _stop(self, signum: int) -> None:
        """Stop the children still running: SIGINT (as Ctrl-C stops a single
        run: what was generated is written), or SIGKILL."""
        if signum == signal.SIGINT:
            self.stop_deadline = time.monotonic() + STOP_GRACE
        for child in self.children:
            if child.process.poll() is None:
                _signal(child, signum)
                child.state = "stopping" if signum == signal.SIGINT else "killed"

    def _show(self) -> None:
        every = BAR_EVERY if self.bar else LOG_EVERY
        if time.monotonic() - self.shown < every:
            return
        self.shown = time.monotonic()
        line = progress_line(self.children, self.total.left)
        if self.bar:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        else:
            logger.info("%s", line)

    def result(self) -> dict[str, Any]:
        if self.failed is not None:
            child = self.failed
            if child.process.returncode == 2:  # its usage error: the user's to fix
                raise UsageError(f"shard {child.slot.name}: {failure(child, self.out)}")
            raise SpecShimError(
                f"shard {child.slot.name} failed: {failure(child, self.out)}; its log: "
                f"{child.slot.log(self.out)}. The other shards were stopped; every "
                "file written is whole: rerun the same command to resume"
            )
        if self.interrupts:
            raise InterruptedRunError(
                "interrupted: every shard was stopped; every file written is whole: "
                "rerun the same command to resume"
            )
        firsts = [c.first for c in self.children if c.first is not None]
        return {
            "written": sum(c.samples for c in self.children),
            "tokens": sum(c.tokens for c in self.children),
            "seconds": time.time() - min(firsts) if firsts else 0.0,
            "skipped": sum(skipped(c.slot.log(self.out)) for c in self.children),
        }


STOP_GRACE = 300.0  # seconds a stopped shard has to finish its batch


def progress_line(children: list[_Child], left: int | None) -> str:
    """Combined pace and ETA, then each shard's state and samples."""
    samples = sum(c.samples for c in children)
    tokens = sum(c.tokens for c in children)
    firsts = [c.first for c in children if c.first is not None]
    span = time.time() - min(firsts) if firsts else 0.0
    pace = f"{tokens / span:,.0f} tok/s" if span > 0 else "- tok/s"
    eta = "?"
    if left is not None and span > 0 and samples:
        seconds = max(left - samples, 0) / (samples / span)
        eta = time.strftime("%H:%M:%S", time.gmtime(seconds))
    shards = ", ".join(f"{c.slot.name} {c.state} {c.samples}" for c in children)
    return f"extract: {samples} samples, {pace}, ETA {eta}; shards: {shards}"
