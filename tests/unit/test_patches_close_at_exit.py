"""The close_at_exit patch and specshim.close: closing generators at exit,
on a failed constructor, and what closing waits for and lets go of."""

from __future__ import annotations

import logging

import pytest


def test_closing_at_exit_drops_log_lines_whose_stream_is_closed(capsys):
    """vLLM 0.25+ logs its shutdown while specshim closes a generator at exit;
    a handler whose stream pytest already closed printed "--- Logging error
    ---" tracebacks after a test run's summary (seen on vLLM 0.26.0)."""
    import io

    from specshim.patches.main import close_at_exit

    closed = io.StringIO()
    closed.close()
    handler = logging.StreamHandler(closed)
    shutdown_logger = logging.getLogger("specshim.test.shutdown")
    shutdown_logger.addHandler(handler)
    shutdown_logger.setLevel(logging.INFO)
    stopped = []

    class Executor:
        def shutdown(self):
            shutdown_logger.info("[shutdown] waiting for worker exit")
            stopped.append(True)

    class Generator:
        pass

    generator = Generator()
    generator.executor = Executor()
    close_at_exit._OPEN.add(generator)
    raising = logging.raiseExceptions
    try:
        close_at_exit._close_open()
    finally:
        shutdown_logger.removeHandler(handler)
    assert stopped == [True] and "executor" not in vars(generator)
    assert "Logging error" not in capsys.readouterr().err
    assert logging.raiseExceptions is raising


def _half_built_generator(context, shutdown_error=None):
    """A generator class whose constructor starts an executor, then refuses
    (as speculators' does when a worker refuses the set-up). Its queue holds
    a connected in-process PAIR, as vLLM's spin condition does (0.24+)."""
    import zmq

    class Queue:
        def __init__(self):
            self.read_cancel_socket = context.socket(zmq.PAIR)
            self.read_cancel_socket.bind("inproc://specshim-test-cancel")
            self.write_cancel_socket = context.socket(zmq.PAIR)
            self.write_cancel_socket.connect("inproc://specshim-test-cancel")

    class Executor:
        stopped = 0

        def __init__(self):
            self.rpc_broadcast_mq = Queue()

        def shutdown(self):
            Executor.stopped += 1
            self.rpc_broadcast_mq.write_cancel_socket.send(b"cancel")
            if shutdown_error:
                raise shutdown_error

    class Generator:
        def __init__(self):
            self.executor = Executor()
            raise ValueError("run the model in bfloat16")

    return Generator, Executor


@pytest.mark.parametrize("shutdown_error", [None, RuntimeError("worker gone")])
def test_a_constructor_that_raises_is_closed_before_its_error_goes_on(shutdown_error):
    """A refusal at set-up used to leave the workers polling and the queue
    sockets open: their context's termination (its garbage collection) then
    waited forever; a pytest run on vLLM 0.24.0's CUDA build hung in its
    summary. The caller sees the constructor's error, also when closing
    fails, and the context ends at once."""
    import threading

    import zmq

    from specshim.patches.main import close_at_exit

    context = zmq.Context()
    generator_class, executor_class = _half_built_generator(context, shutdown_error)
    wrapped = close_at_exit._build(generator_class.__init__)
    generator = generator_class.__new__(generator_class)
    with pytest.raises(ValueError, match="bfloat16"):
        wrapped(generator)
    assert executor_class.stopped == 1
    assert "executor" not in vars(generator)
    assert generator not in close_at_exit._OPEN
    ended = threading.Thread(target=context.term, daemon=True)
    ended.start()
    ended.join(timeout=20)
    assert not ended.is_alive(), "the queue's zmq context did not terminate"


@pytest.mark.parametrize("user_set", [False, True])
def test_closing_waits_for_slow_workers_before_vllms_grace_period(
    monkeypatch, user_set
):
    """vLLM's 5 s grace period then SIGTERM printed a warning at a script's
    exit when a CPU worker was slow to leave (seen on vLLM 0.32.0, 2 cores):
    close() waits for the signalled workers first, unless the user set vLLM's
    own timeout."""
    import specshim
    from specshim import _closing

    if user_set:
        monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5")
    else:
        monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setattr(_closing, "GRACE_S", 5.0)

    class Proc:
        polls = 0

        def is_alive(self):
            Proc.polls += 1
            return Proc.polls < 4  # leaves on the fourth look

    seen = []

    class Executor:
        @staticmethod
        def _ensure_worker_termination(procs):  # vLLM's: warns if alive
            seen.append([p.is_alive() for p in procs])

        def shutdown(self):
            self._ensure_worker_termination([Proc()])

    class Generator:
        pass

    generator = Generator()
    generator.executor = Executor()
    specshim.close(generator)
    assert seen == ([[True]] if user_set else [[False]])


@pytest.mark.parametrize("how", ["closed", "collected"])
def test_a_generator_closed_or_collected_unmaps_its_workers_slabs(monkeypatch, how):
    """The main process kept every slab a closed generator's workers had
    handed it mapped (8 calls' states) until it exited. The hand-over's side
    in this process hears of it through specshim.close's callbacks."""
    import gc
    import types

    import specshim
    from specshim import _closing
    from specshim.patches._transport import handed_states as _handed_states
    from specshim.patches.main import close_at_exit

    assert _handed_states.forget in _closing._GONE
    forgotten = []
    monkeypatch.setattr(_closing, "_GONE", [forgotten.append])

    class Executor:
        workers = [
            types.SimpleNamespace(proc=types.SimpleNamespace(pid=p)) for p in (11, 12)
        ]

        def shutdown(self):
            pass

    class Generator:
        def __init__(self):
            self.executor = Executor()

        def __del__(self):  # speculators' own: shuts the executor down
            if hasattr(self, "executor"):
                self.executor.shutdown()

    generator = Generator.__new__(Generator)
    close_at_exit._build(Generator.__init__)(generator)
    if how == "closed":
        specshim.close(generator)
        assert forgotten == [[11, 12]]
    del generator
    gc.collect()
    assert forgotten[-1] == [11, 12]
