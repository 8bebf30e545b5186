"""Model FLOPs of one training batch, counted once with ``torch.utils.flop_counter`` on a
meta-device copy of the model (no memory, no compute): the input of the MFU estimate
(``start_run(flops_per_batch=...)``). torch is imported only when called."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def meta_copy(model: Any) -> Any:
    """A copy of ``model`` whose parameters and buffers are on the meta device, made
    without copying their data: a plain ``deepcopy`` clones every parameter on its own
    device first (a large model can run out of memory, and the peak-memory statistics
    grow). Parameters keep ``requires_grad``; gradients are not copied."""
    import torch

    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(
            torch.empty_like(parameter, device="meta"), parameter.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    # Tensors held otherwise (plain attributes) are copied as deepcopy does, then moved.
    return copy.deepcopy(model, memo).to("meta")


def count_flops_per_batch(model: Any, batch: Any, loss: Callable[[Any], Any] | None = None) -> int:
    """FLOPs of ``model`` on ``batch`` (a tensor, or a tuple/list/dict of them), forward and
    backward, as ``torch.utils.flop_counter.FlopCounterMode`` counts them on meta-device
    copies; ``loss`` maps the output to the scalar the backward starts from (default: its
    sum). Raises what torch raises for a model that cannot run on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    meta_model = meta_copy(model)

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
        if isinstance(value, (list, tuple)):
            return type(value)(to_meta(v) for v in value)
        if isinstance(value, dict):
            return {k: to_meta(v) for k, v in value.items()}
        return value

    meta_batch = to_meta(batch)
    counter = FlopCounterMode(display=False)
    with counter:
        if isinstance(meta_batch, dict):
            output = meta_model(**meta_batch)
        elif isinstance(meta_batch, (list, tuple)):
            output = meta_model(*meta_batch)
        else:
            output = meta_model(meta_batch)
        (loss(output) if loss is not None else output.sum()).backward()
    return int(counter.get_total_flops())
