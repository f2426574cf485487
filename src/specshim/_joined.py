"""A layer's rows as the pieces they lie in, one after another, not copied
into one tensor: what ``prefix_rows`` hands ``extract``'s writer where the
store asks for it (``PrefixRows.pieces``), so a sample served a prefix is
written from its served rows and its computed rows directly, and its bytes
are copied once (into the file) instead of twice (into a joined tensor on the
main thread, between vLLM's steps, then into the file).

Only ``extract`` asks for it: ``generate()`` returns tensors to every other
caller, as speculators' API says. ``job/extract/torch_file`` writes a
``Joined`` as the tensor it stands for, byte for byte (the first file of each
shape is compared with ``torch.save`` of the joined tensor).

The pieces are views of memory nobody writes again while they live: the
call's captured rows (a slab is lent again only once every tensor over it is
gone), blocks the store keeps (copies it never writes), and other
sequences' pieces of the same call.
"""

from __future__ import annotations

from typing import Any


class Joined:
    """Rows of one layer: ``parts`` (tensors of equal row shape and dtype),
    one after another. Reads as much of a tensor as the store and the guard
    use (``shape``, ``dtype``, a span of rows, ``clone``); ``tensor`` joins
    them."""

    __slots__ = ("dtype", "parts", "shape")

    def __init__(self, parts: list[Any]) -> None:
        flat: list[Any] = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, Joined) else [part])
        flat = merged([p for p in flat if p.shape[0]] or flat[:1])
        if not flat:
            raise ValueError("a Joined of no pieces")
        first = flat[0]
        for part in flat[1:]:
            if part.shape[1:] != first.shape[1:] or part.dtype != first.dtype:
                raise ValueError(
                    f"pieces of rows {tuple(first.shape[1:])} {first.dtype} and "
                    f"{tuple(part.shape[1:])} {part.dtype} in one layer"
                )
        self.parts = flat
        self.dtype = first.dtype
        self.shape = (sum(p.shape[0] for p in flat), *first.shape[1:])

    def __getitem__(self, rows: slice) -> Joined:
        """Rows ``[start, stop)`` (a step of one), as views of the pieces."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("a Joined is read by spans of rows")
        out: list[Any] = []
        at = 0
        for part in self.parts:
            end = at + part.shape[0]
            if end > start and at < stop:
                out.append(part[max(start - at, 0) : min(stop, end) - at])
            at = end
        if not out:
            return Joined([self.parts[0][:0]])
        # Spans of pieces no two of which follow one another follow one
        # another no more: taken as they are, not merged again.
        span = Joined.__new__(Joined)
        span.parts, span.dtype = out, self.dtype
        span.shape = (stop - start, *self.shape[1:])
        return span

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def element_size(self) -> int:
        return int(self.parts[0].element_size())

    def lone(self) -> Any:
        """The one piece, where it is all of its storage (the rows as a
        tensor of their own, uncopied); else None."""
        if len(self.parts) == 1 and alone(self.parts[0]):
            return self.parts[0]
        return None

    def tensor(self) -> Any:
        """The rows as one tensor of their own (a copy, unless ``lone``)."""
        import torch

        lone = self.lone()
        return torch.cat(self.parts) if lone is None else lone

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Joined is written by extract's writer as the tensor it stands "
            "for, never pickled as itself (Joined.tensor() joins it)"
        )

    def clone(self) -> Any:
        """A copy of the rows, in storage of their own."""
        import torch

        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0].clone()


def joined_tensors(obj: Any) -> Any:
    """``obj`` with every ``Joined`` in it joined into a tensor: what
    ``torch.save`` is given where a file is not written from its pieces."""
    return replaced(obj, lambda joined: joined.tensor())


def replaced(obj: Any, each: Any) -> Any:
    """``obj`` with every ``Joined`` in its dicts, lists and tuples replaced
    by ``each(joined)``; a container with none in it is ``obj``'s own (the
    same object: its type, and what else refers to it, unchanged)."""
    if isinstance(obj, Joined):
        return each(obj)
    if isinstance(obj, dict):
        values = {key: replaced(value, each) for key, value in obj.items()}
        if all(values[key] is value for key, value in obj.items()):
            return obj
        out = obj.copy()
        out.update(values)
        return out
    if isinstance(obj, (list, tuple)):
        items = [replaced(value, each) for value in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            return type(obj)(items)
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def merged(parts: list[Any]) -> list[Any]:
    """``parts`` with each run of pieces that lie one after another in the
    same storage (consecutive blocks of one kept copy, or of the sequence of
    the call that computed them) read as one piece: the same rows, in fewer
    copies."""
    out: list[Any] = []
    for part in parts:
        if out and _follows(out[-1], part):
            last = out[-1]
            shape = (last.shape[0] + part.shape[0], *last.shape[1:])
            out[-1] = last.as_strided(shape, last.stride(), last.storage_offset())
        else:
            out.append(part)
    return out


def _follows(a: Any, b: Any) -> bool:
    """Whether ``b``'s rows start where ``a``'s end, in the same storage."""
    return (  # the cheapest test first: most pieces do not touch
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.dtype == b.dtype
        and a.shape[1:] == b.shape[1:]
        and _packed(a)
        and _packed(b)
    )


def _packed(tensor: Any) -> bool:
    """Rows of at least one, each right after the one before: a span of
    more of them (``as_strided`` with its strides) reads the rows after it.
    ``is_contiguous`` alone passes a single row of any stride."""
    if tensor.dim() < 1 or tensor.shape[0] == 0 or not tensor.is_contiguous():
        return False
    return tensor.stride(0) == tensor[0].numel()


def alone(tensor: Any) -> bool:
    """Whether ``tensor`` is all of its storage (no view of a larger one)."""
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and (
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
    )
