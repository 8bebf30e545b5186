"""Batch sizes read from the batches themselves, for runs that did not give them.

A loop driver or callback hands over every batch; the size is read where it is
unambiguous and sent to the sidecar (a ``batch_size`` control) when it changed, naming
the iteration and the batch within it from which it applies, so throughput counts the
samples the iterations really held: with accumulation, a short last batch inside a step
counts what it holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from markers import wire
from markers.transport import Sender


def _samples(batch: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``batch`` is a list of samples as they are (an identity ``collate_fn``, or a
    batch class of its own), never a default-collated list of fields: ``default_collate``
    gives plain lists, turns tuple samples into lists and transposes token lists, and
    keeps a mapping's own class only in a single collated mapping."""
    if not isinstance(batch, list):
        return False
    if type(batch) is not list:
        return True  # a batch class of its own (clinicadl's Batch of subjects)
    return (
        all(isinstance(item, tuple) and not hasattr(item, "_fields") for item in batch)
        or all(
            isinstance(item, list) and all(isinstance(x, (int, float, str)) for x in item)
            for item in batch
        )
        or all(isinstance(item, Mapping) and type(item) is not dict for item in batch)
    )


def first_dims(batch: Any, depth: int = 3) -> set[int] | None:
    """The first dimensions found in ``batch``: a tensor's (anything with ``shape``), those
    of the fields of a tuple, a default-collated list or a mapping (``(inputs, labels)``,
    ``{"input_ids": ...}``), the length of a list of strings or numbers, the length of a
    list of samples as they are (``_samples``: tuples, token lists or sample objects such
    as torchio subjects, as an identity ``collate_fn`` gives, or a list subclass such as
    clinicadl's ``Batch``). None when it cannot tell: a plain list of plain dicts or lists
    (samples, or the fields of collated tuple samples), or an object without a shape.
    """
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return {int(shape[0])} if len(shape) else set()
    if batch is None or isinstance(batch, (str, bytes, int, float)):
        return set()
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
        texts = all(isinstance(item, str) for item in items)
        scalars = isinstance(batch, list) and all(isinstance(i, (int, float)) for i in items)
        if items and (texts or scalars or _samples(batch)):
            return {len(items)}  # texts, scalar samples, or samples as they are
        if (
            isinstance(batch, list)
            and items
            and all(isinstance(item, (list, tuple, Mapping)) for item in items)
        ):
            return None  # samples, not fields: the batch size is ambiguous
    else:
        return None
    if depth == 0:
        return None
    sizes: set[int] = set()
    for item in items:
        found = first_dims(item, depth - 1)
        if found is None:
            return None
        sizes |= found
    return sizes


def _leading_dim(batch: Any) -> int | None:
    """The first dimension of ``batch`` if it is a tensor, else of its first field (a
    tuple, list or dict of tensors); None when that has no shape (a sample, a 0-d
    tensor)."""
    kind = type(batch)
    if kind is tuple or kind is list:
        first = batch[0] if batch else None
    elif kind is dict:
        first = next(iter(batch.values()), None)
    else:
        first = batch
    shape = getattr(first, "shape", None)
    return shape[0] if isinstance(shape, tuple) and shape else None


def batch_size(batch: Any) -> int | None:
    """The batch size of ``batch`` where it is unambiguous (see ``first_dims``: every
    first dimension found agrees), else None.

    The shapes of nearly every loop (a tensor; a tuple, list or dict of tensors, none of
    them 0-d) are read here directly: a loop driver sizes every batch, and ``first_dims``
    (an ABC check and a recursion) costs microseconds a step. Anything else, or fields
    that disagree, goes to ``first_dims``, which decides those shapes the same way.
    """
    kind = type(batch)
    items = batch.values() if kind is dict else batch if kind is tuple or kind is list else (batch,)
    size = None
    for item in items:
        shape = getattr(item, "shape", None)
        if not isinstance(shape, tuple) or not shape or (size is not None and shape[0] != size):
            break  # no tensor, a 0-d one or a disagreement: first_dims tells
        size = shape[0]
    else:
        if size is not None:
            return int(size)
    sizes = first_dims(batch)
    return sizes.pop() if sizes and len(sizes) == 1 else None


class BatchSizes:
    """The batch sizes of one run, by ``validation``: read from every batch and sent when
    they change. A size given to ``start_run`` stands for the batches that cannot tell; a
    readable size wins over it (a short last batch counts what it holds)."""

    __slots__ = ("_given", "_read", "_sender", "_sized")

    def __init__(self, sender: Sender, hello: dict[str, Any]) -> None:
        self._sender = sender
        self._given: list[int | None] = [
            hello.get(key) for key in ("train_batch_size", "val_batch_size")
        ]
        # The size in force (0: the batches cannot tell), None before the first batch; a
        # given size is in force from the start (the sidecar has it from the hello).
        self._read: list[int | None] = list(self._given)
        # The batch read last, (iteration, position): a hook that sees the batch a loop
        # driver already read (its forward's arguments) reads nothing.
        self._sized: list[tuple[int, int] | None] = [None, None]

    def seen(self, validation: bool, iteration: int, position: int, batch: Any) -> None:
        """Batch ``position`` (0 first) of iteration number ``iteration`` was fetched: its
        size is read (once) and sent when it changed (a batch that cannot tell has the
        given size, if any); without a given size, a batch that cannot tell gives one
        RuntimeWarning (at the caller of ``Run.batch_seen``)."""
        where = (iteration, position)
        if self._sized[validation] == where:
            return
        self._sized[validation] = where
        given = self._given[validation]
        # A first field whose first dimension is the given size settles it: the batch reads
        # as that size or, its fields disagreeing, as unknown, which the given size stands
        # for. One shape read instead of every field's (a shape read costs ~0.2 µs).
        if given is None or _leading_dim(batch) != given:
            size = batch_size(batch) or given or 0
        else:
            size = given
        if size == self._read[validation]:
            return
        first = self._read[validation] is None
        self._read[validation] = size
        kind = "validation" if validation else "train"
        self._sender.send_control(
            {
                "type": wire.BATCH_SIZE,
                "kind": kind,
                "value": size or None,
                "iteration": iteration,
                "position": position,
            }
        )
        if not size and first:
            name = "val_batch_size" if validation else "train_batch_size"
            warnings.warn(
                f"markers: the {kind} batch size cannot be read from a batch of "
                f"type {type(batch).__name__} (ambiguous: give {name}= to "
                "start_run); its throughput is reported as unknown",
                RuntimeWarning,
                stacklevel=3,
            )
