"""``specshim extract``: a dataset in, speculators training files out.

Sample i of the dataset always lands in ``OUT/data_{i}.pt`` (the layout
speculators 0.3.0's trainer reads: ``input_ids``, ``hidden_states`` as one
tensor per layer in layer order, ``loss_mask``). Files are written under a
hidden temporary name that does not end in ``pt`` and renamed into place, so a
killed run never leaves a partial file where the trainer would pick it up.

Rerunning the same command resumes. What is already there is judged by
content (``specshim.job.outdir.store``): a file counts as done only if a manifest line
describes that very file and says it holds what sample i of the dataset holds
now; anything else is rewritten, and the run says how many and why. The
settings (model, layers, max length, vLLM and speculators versions) are fixed
by the first sample written, in ``data_config.json``. ``--shard I/N`` takes
samples with ``i % N == I``; any number of shards, on any hosts sharing the
directory, can write into it at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specshim import _settings
from specshim._base import SLAB_ROWS, SLABS, SpecShimError, UsageError
from specshim._environ import scoped_environ
from specshim._prefix_reuse import REUSE
from specshim.job.extract import reuse, startup
from specshim.job.extract.feed import Feed, Todo
from specshim.job.extract.options import ExtractOptions
from specshim.job.extract.plan import RunPlan, plan_run
from specshim.job.extract.prefixes import SMALLEST_BLOCK, may_share
from specshim.job.extract.timing import where_time_went
from specshim.job.extract.writer import IN_FLIGHT, Progress, Writer, drain
from specshim.job.inputs.tokenizing import warn_truncated
from specshim.job.kv_cache import cpu_kv_cache_space, cpu_kv_space, on_cpu
from specshim.job.outdir import store as _store
from specshim.job.outdir.data_config import check_identity

logger = logging.getLogger(__name__)


def extract(options: ExtractOptions) -> dict[str, Any]:
    """Run the job; returns counts. Raises SpecShimError on bad input or a crash.

    The step budget it sets (``step_settings``) is undone on return; vLLM's
    CPU KV-cache variable is set only while the generator starts.
    """
    with _settings.preserved():
        return _extract(options)


def _extract(options: ExtractOptions) -> dict[str, Any]:
    # Cheap checks first: the plan (model, flags, paths), then what --out
    # already holds, before the dataset is read or a model is loaded.
    plan = plan_run(options)
    run, cleaned = _store.open_run(plan.out, {"shard": list(plan.shard)})
    feed = None
    try:
        if cleaned:
            logger.info("extract: removed %d leftovers of runs that died", cleaned)
        feed = Feed(plan.feed).start()
        logger.info(
            "extract: streaming %s (shard %d/%d), layers %s; step budget %s",
            plan.data,
            *plan.shard,
            list(plan.layers),
            ", ".join(
                f"{k}={v['value']} ({v['source']})" for k, v in plan.settings.items()
            ),
        )
        counts = _Pipeline(plan, run).run(feed)
        return _finish(plan, feed, run, counts)
    finally:
        if feed is not None:
            feed.close()
        run.close()


def _finish(
    plan: RunPlan, feed: Feed, run: _store.Run, counts: dict[str, Any]
) -> dict[str, Any]:
    """Record the dataset's size, say what the run found, return the counts."""
    warn_truncated(feed.truncated, feed.samples, plan.max_len)
    run.annotate({"dataset_samples": feed.total, "finished": time.time()})
    settled = _store.settle_orphans(plan.out, feed.total, run.id, plan.move_orphans)
    _handle_orphans(plan, feed.total, *settled)
    for why, count in feed.rewrites.items():
        logger.warning("extract: rewrote %d file(s): %s", count, why)
    if not counts["written"]:
        logger.info("extract: all %d samples of this shard already exist", feed.done)
    return counts | {
        "shard_samples": feed.samples,
        "dataset_samples": feed.total,
        "skipped": feed.done,
        "rewritten": dict(feed.rewrites),
    }


def _handle_orphans(
    plan: RunPlan,
    total: int,
    foreign: list[str],
    found: list[int],
    folder: Path | None,
) -> None:
    """Files past the dataset's end were moved aside (``--move-orphans``) or
    are refused: speculators' trainer would read them as training data."""
    if foreign:
        logger.warning(
            "extract: %s holds %d file(s) that speculators' trainer would read "
            "and that are no sample's (%s); move or rename them",
            plan.out,
            len(foreign),
            ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else ""),
        )
    if not found:
        return
    names = ", ".join(f"data_{i}.pt" for i in found[:3]) + (
        " ..." if len(found) > 3 else ""
    )
    if folder is not None:
        logger.warning(
            "extract: moved %d file(s) of samples %s does not have (%s) to %s",
            len(found),
            plan.data,
            names,
            folder,
        )
        return
    raise UsageError(
        f"{plan.out} holds {len(found)} file(s) of samples {plan.data} does "
        f"not have ({names}; it has {total} samples), which speculators' trainer "
        "would read; every sample of the dataset is written. Rerun with "
        "--move-orphans to move them to .specshim/orphans/, or delete them"
    )


class _Pipeline:
    """Batches the feed, generates, and hands each batch to the writer.

    The generator is built when the first batch is full (or the feed ends), so
    a bad record among the first samples, or a shard with nothing left to do,
    never loads a model. Whatever stops the run, the batches already generated
    are written before the error is raised.
    """

    def __init__(self, plan: RunPlan, run: _store.Run) -> None:
        self.plan, self.run_ = plan, run
        self.generator: Any = None
        self.writer: Writer | None = None
        self.progress: Progress | None = None
        self.published = False
        self.began = time.monotonic()
        self.first_generate: float | None = None  # seconds from the start
        self.handing = 0.0  # in writer.put
        self.calls: list[float] = []  # each generate() call's seconds
        self.ended = 0.0  # when the last file was committed
        self.handed = 0.0  # when the last batch was handed to the writer
        self.reuse: reuse.Reuse | None = None  # --reuse-prefixes
        # vLLM's prefix cache on: --reuse-prefixes, where samples may share.
        self.caching = plan.reuse_prefixes

    def _samples(self, feed: Feed) -> Iterable[Todo]:
        """The feed; with --reuse-prefixes, all of it, in the plan's order."""
        if not self.plan.reuse_prefixes:
            return feed
        todos = list(feed)
        if not todos:
            return todos
        if not may_share(todo.input_ids for todo in todos):
            # Nothing the cache could serve: it stays off, sparing vLLM's
            # hashing of every block of every call (on an H100, a 1.2B
            # model's calls took 12% longer with it on and nothing shared).
            logger.info(
                "extract: --reuse-prefixes: no two samples share their first "
                "%d tokens (vLLM's smallest KV-cache block), so no prefix "
                "can be served; the prefix cache stays off and every token is "
                "computed, as without the flag",
                SMALLEST_BLOCK,
            )
            self.caching = False
            return todos
        # Slabs sized as extract sizes them without the flag: reused calls
        # capture fewer rows than their batch's tokens, so these fit them.
        self._start(todos[: self.plan.batch_size])
        # The rate's clock starts here: the plan is part of the run's cost.
        self.first_generate = time.monotonic() - self.began
        ordered, self.reuse = reuse.planned(
            todos,
            self.generator,
            len(self.plan.layers),
            self.plan.reuse_cap_mib,
            self.plan.shard,
        )
        return ordered

    def run(self, feed: Feed) -> dict[str, Any]:
        batch: list[Todo] = []
        try:
            for todo in self._samples(feed):
                batch.append(todo)
                if len(batch) == self.plan.batch_size:
                    self._step(batch)
                    batch = []
            if batch:
                self._step(batch)
            if self.writer is not None:
                self.writer.finish()
                self.ended = time.monotonic()  # the engine's shutdown is not counted
        except BaseException:
            if self.writer is not None:
                drain(self.writer)  # what was generated is still written
            raise
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.generator is not None:
                _shutdown(self.generator)
        if self.writer is None:
            return {"written": 0, "tokens": 0, "seconds": 0.0}
        reused = self.reuse.report() if self.reuse is not None else {}
        return self._counts(self.writer) | reused

    def _counts(self, writer: Writer) -> dict[str, Any]:
        """What the run wrote, at what rate, and where its time went (logged:
        the run's own profile, first thing to read when it is slow)."""
        assert self.first_generate is not None
        seconds = self.ended - self.began - self.first_generate
        finishing = self.ended - self.handed if self.handed else 0.0
        timing = where_time_went(seconds, self.calls, self.handing, finishing, writer)
        return {
            "written": writer.written,
            "tokens": writer.tokens,
            "seconds": seconds,
            "first_generate_seconds": self.first_generate,
            "timing": timing,
        }

    def _start(self, first: list[Todo] | None = None) -> None:
        """Start the engine; with the ``first`` batch in hand, its workers
        make the slabs the writer will hold while they start (one for each
        batch in flight: ``IN_FLIGHT``), sized for batches of its tokens."""
        plan = self.plan
        space = None
        if on_cpu():
            space, source = cpu_kv_space(plan.cpu_kv_space_gib, plan.kv_need_bytes)
            logger.info("extract: vLLM CPU KV-cache space %d GiB (%s)", space, source)
        wanted = {REUSE: "1"} if self.caching else {}
        if first and not {SLAB_ROWS, SLABS} & os.environ.keys():  # or the user's
            rows = sum(len(todo) for todo in first)
            wanted |= {SLAB_ROWS: str(rows), SLABS: str(IN_FLIGHT)}
        with cpu_kv_cache_space(space), scoped_environ(wanted), startup.announced():
            self.generator = _make_generator(plan)
        self.progress = Progress(plan.progress)
        self.writer = Writer(self.run_, self.progress)

    def _step(self, batch: list[Todo]) -> None:
        if self.generator is None:
            self._start(batch)
        assert self.writer is not None
        self.writer.check()
        if self.first_generate is None:
            self.first_generate = time.monotonic() - self.began
        started = time.monotonic()
        results = _generate(self.generator, batch, self.writer)
        self.calls.append(time.monotonic() - started)
        if self.reuse is not None:
            self.reuse.after(self.generator, batch)
        if len(results) != len(batch):
            raise SpecShimError(
                f"the generator returned {len(results)} results for {len(batch)} "
                "samples; nothing of this batch was written"
            )
        if not self.published:  # the settings are fixed by the first sample
            in_force = self.run_.publish_config(self.plan.output_config)
            check_identity(self.plan.out, in_force, self.plan.identity)
            self.published = True
        started = time.monotonic()
        self.writer.put(batch, results)
        self.handed = time.monotonic()
        self.handing += self.handed - started


def _make_generator(plan: RunPlan) -> Any:
    # specshim is imported (this module is part of it), so the patches are
    # armed before speculators' modules load here.
    from speculators.data_generation import VllmHiddenStatesGenerator

    try:
        return VllmHiddenStatesGenerator(
            str(plan.model.path),
            layer_ids=list(plan.layers),
            max_model_len=plan.max_model_len,
            gpu_memory_utilization=plan.gpu_memory_utilization,
            tensor_parallel_size=plan.tp,
        )
    except SpecShimError:
        raise
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # vLLM's config classes validate with pydantic, before any worker
        # starts: what they refuse is a value given here, said in one line.
        if type(exc).__name__ == "ValidationError":
            reason = (lines[1:] or lines or [repr(exc)])[0]
            reason = reason.removeprefix("Value error, ")
            raise UsageError(
                f"vLLM refused these settings: {reason}{_disabled_hint()}"
            ) from None
        # Anything else stopped the workers from starting: vLLM logged why.
        first = lines[0] if lines else ""
        raise SpecShimError(
            f"the generator could not start ({type(exc).__name__}: {first}); the "
            f"vLLM log above says why{_disabled_hint()}. Nothing was written in "
            "this run."
        ) from exc


def _disabled_hint() -> str:
    """Where ``SPECSHIM_DISABLE`` turns patches off, a failed start names
    them: a patch this vLLM needs, turned off, fails as the drift it fixes
    ("is_encoder_decoder"), which says nothing of the variable."""
    from specshim._settings import disabled_ids

    off = sorted(disabled_ids())
    if not off:
        return ""
    return (
        f" (SPECSHIM_DISABLE turns off {', '.join(off)}: this vLLM may need "
        "them; unset it and rerun)"
    )


def _generate(generator: Any, batch: list[Todo], writer: Writer) -> list[Any]:
    try:
        return generator.generate([t.input_ids.tolist() for t in batch])
    except Exception as exc:
        if getattr(generator.executor, "is_failed", False):
            drain(writer)  # the batches already generated are written
            raise SpecShimError(
                "a vLLM worker process died during extraction (see its log above: "
                "out of memory and a killed process are the usual causes). "
                f"{writer.written} samples were written in this run and are "
                "complete; rerun the same command to resume from there."
            ) from exc
        if isinstance(exc, SpecShimError):
            raise  # the row guard's refusal says what it found
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SpecShimError(
            f"generate() failed ({type(exc).__name__}: {first}) on samples "
            f"{_spelled(batch)}; nothing of this batch was written. The batches "
            "before it are, and a rerun resumes from there."
        ) from exc


def _spelled(batch: list[Todo]) -> str:
    """The batch's sample indexes: a range where they run without a gap,
    else each, the first ten (a resumed run skips samples already written,
    and --reuse-prefixes reorders the feed)."""
    first, last = batch[0].index, batch[-1].index
    if [t.index for t in batch] == list(range(first, last + 1)):
        return f"{first} to {last}"
    more = f" ... ({len(batch)} in all)" if len(batch) > 10 else ""
    return ", ".join(str(t.index) for t in batch[:10]) + more


def _shutdown(generator: Any) -> None:
    from specshim import close

    try:
        close(generator)
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.debug("executor shutdown failed", exc_info=True)
