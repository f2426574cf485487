"""Functions tests send to vLLM workers with ``executor.collective_rpc(fn)``.

They live in the installed package so that spawned workers can import them.
"""

from __future__ import annotations

from typing import Any


def tower_parameter_count(worker: Any) -> int:
    """Parameters of a multimodal model's encoder towers in this worker."""
    model = worker.model_runner.model
    names = getattr(model, "_tower_model_names", None) or ()
    return sum(
        param.numel()
        for name, param in model.named_parameters()
        if name.split(".", 1)[0] in names
    )


def sort_steps_by_token_count(worker: Any, on: bool = True) -> None:
    """Lay out every step's requests longest first: another order than the
    one ``generate-guard`` sends them in (shortest first, which vLLM's V2 GPU
    runner keeps, as its sort by token count is ascending).

    A test-only change to a live V1 runner (the V2 runner cannot run on the
    CPU backend): after the runner's own reordering, the persistent batch is
    sorted by scheduled tokens, so the forward computes the requests in
    another order than the scheduler's and speculators' input order.
    ``on=False`` puts the runner back.
    """
    runner = worker.model_runner
    original = getattr(runner, "_specshim_test_unsorted", None)
    if not on:
        if original is not None:
            runner._may_reorder_batch = original
            del runner._specshim_test_unsorted
        return
    if original is not None:
        return
    reorder = runner._may_reorder_batch

    def may_reorder_batch(scheduler_output: Any) -> None:
        reorder(scheduler_output)
        batch = runner.input_batch
        counts = scheduler_output.num_scheduled_tokens
        for i in range(batch.num_reqs):
            ids = batch.req_ids
            longest = max(range(i, batch.num_reqs), key=lambda j: counts[ids[j]])
            if counts[ids[longest]] > counts[ids[i]]:
                batch.swap_states(i, longest)

    runner._specshim_test_unsorted = reorder
    runner._may_reorder_batch = may_reorder_batch


def early_fetches(worker: Any) -> int | None:
    """How many fetches this worker answered with the rows it copied out as
    they were captured (``_transport/early_copies``); None where its capture
    does not run through ``capture-hooks`` (vLLM 0.11: speculators' own
    forward), which is what makes those copies."""
    worker = vars(worker).get("worker", worker)
    if not getattr(worker, "_specshim_hooks", None):
        return None
    region = getattr(worker, "_specshim_region", None)
    return 0 if region is None else region.early_fetches


def tamper_captured_rows(worker: Any, mode: str | None) -> None:
    """Drop (``"drop"``) or repeat (``"duplicate"``) the last captured row of
    every forward before specshim records it; ``None`` stops tampering.

    Stands in for a runner that pads, trims or repeats rows inside the worker.
    """
    # collective_rpc hands functions vLLM's WorkerWrapperBase, which forwards
    # reads (not writes) to the worker that speculators' extension is part of.
    worker = vars(worker).get("worker", worker)
    original = getattr(worker, "_specshim_test_untampered", None)
    if mode is None:
        if original is not None:
            worker._store_captured_states = original
            del worker._specshim_test_untampered
        return
    store = original or worker._store_captured_states

    def store_captured_states(states: Any) -> Any:
        import torch

        if mode == "drop":
            states = [h[:-1] for h in states]
        else:
            states = [torch.cat([h, h[-1:]]) for h in states]
        return store(states)

    worker._specshim_test_untampered = store
    worker._store_captured_states = store_captured_states


def pad_steps(worker: Any, rows: int) -> None:
    """Pad every forward's input with ``rows`` extra tokens (id 0, position 0),
    as a runner that pads a step to a captured or aligned size does; ``rows=0``
    stops. The padded rows run through every layer, so the capture sees them.
    """
    model = worker.model_runner.model
    handle = getattr(model, "_specshim_test_padding", None)
    if handle is not None:
        handle.remove()
        del model._specshim_test_padding
    if not rows:
        return

    def pad(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        import torch

        ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        if ids is None or positions is None or positions.dim() != 1:
            raise RuntimeError("pad_steps: expected input_ids and 1-D positions")
        kwargs["input_ids"] = torch.cat([ids, ids.new_zeros(rows)])
        kwargs["positions"] = torch.cat([positions, positions.new_zeros(rows)])
        return args, kwargs

    model._specshim_test_padding = model.register_forward_pre_hook(
        pad, with_kwargs=True
    )


def backends(worker: Any) -> dict[str, Any]:
    """What this worker runs: its model runner, and the attention and MoE
    implementations its layers chose (the GPU tier reports them)."""
    runner = worker.model_runner
    attention: set[str] = set()
    moe: set[str] = set()
    for module in runner.model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            attention.add(str(backend.get_name()))
        method = getattr(module, "quant_method", None)
        # The experts' method, wherever it lives: on FusedMoE up to vLLM 0.23,
        # on the RoutedExperts of a MoERunner from 0.24.
        if any(c.__name__ == "FusedMoEMethodBase" for c in type(method).__mro__):
            kernel = getattr(method, "moe_kernel", None) or getattr(
                method, "fused_experts", None
            )
            moe.add(
                type(method).__name__
                + (f"/{type(kernel).__name__}" if kernel is not None else "")
            )
    return {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "attention": sorted(attention),
        "moe": sorted(moe),
    }


def live_requests(worker: Any) -> int:
    """Requests the model runner still holds state for (V1 and V2 runners)."""
    runner = worker.model_runner
    states = getattr(runner, "req_states", None)
    if states is not None:  # the V2 runner: a fixed pool of request slots
        return int(states.num_reqs)
    return len(runner.requests)


def use_transport(worker: Any, mode: str) -> None:
    """Switch how this worker's captured states reach the main process:
    ``"shared"`` (specshim's ``state-transport``, the default), ``"pickled"``
    (speculators' own ``_get_captured_states``: tensors through vLLM's RPC
    queue) or ``"fallback"`` (``state-transport`` finding no slab, as where
    ``/dev/shm`` is too small: numpy arrays through the queue). The worker
    keeps its slabs across switches, as a worker's region lives as long as
    it does: what the caller holds stays held."""
    import types

    from specshim._registry import REGISTRY
    from specshim.patches._transport import shared_states as _shared_states

    if mode not in ("shared", "pickled", "fallback"):
        raise ValueError(f"unknown transport {mode!r}")
    worker = vars(worker).get("worker", worker)
    worker.__dict__.pop("_get_captured_states", None)
    region = _shared_states.region_of(worker)
    region.failure = "fallback forced by a test" if mode == "fallback" else None
    if mode == "pickled":
        original = REGISTRY.record("state-transport").original
        worker._get_captured_states = types.MethodType(original, worker)


def profile_start(worker: Any) -> None:
    """Start torch's profiler in this worker (its CPU and, on a GPU, CUDA
    activity): what ``make bench-gpu --worker-profile`` times."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    worker._specshim_profiler = torch.profiler.profile(activities=activities)
    worker._specshim_profiler.start()


def device_busy(events: Any) -> tuple[float, dict[str, float]]:
    """Microseconds the device was busy in ``events`` (torch's key averages),
    and of them in copies, by kind. Only the device's own events count: an
    operator's event carries its kernels' time too (``aten::mm`` and its
    ``nvjet`` kernels each say the same 290 ms), so summing every event
    counted each kernel twice. This is the sum torch prints as "Self CUDA
    time total"."""
    from torch.autograd import DeviceType

    busy, copies = 0.0, {}
    for event in events:
        if event.device_type == DeviceType.CPU or getattr(
            event, "is_user_annotation", False
        ):
            continue
        spent = float(
            getattr(event, "self_device_time_total", None)
            or getattr(event, "self_cuda_time_total", 0.0)
        )
        busy += spent
        if "memcpy" in event.key.lower():
            copies[event.key] = copies.get(event.key, 0.0) + spent
    return busy, copies


def profile_stop(worker: Any, rows: int = 25) -> dict[str, Any]:
    """Stop ``profile_start``'s profiler: the device's busy time in kernels
    and in copies (microseconds, by kind of copy), and the top ``rows``
    operations as torch's table."""
    profiler = worker.__dict__.pop("_specshim_profiler")
    profiler.stop()
    events = profiler.key_averages()
    busy, copies = device_busy(events)
    sort = "self_cuda_time_total" if busy else "self_cpu_time_total"
    return {
        "device_us": round(busy),
        "copies_us": {k: round(v) for k, v in copies.items() if round(v)},
        "table": events.table(sort_by=sort, row_limit=rows),
    }
