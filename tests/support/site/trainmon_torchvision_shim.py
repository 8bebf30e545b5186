"""Test environment only: make the CUDA build of torchvision importable beside a CPU torch.

The only torchvision of torch 2.13's series that the package index serves here is the CUDA
build. Its ``_C.so`` needs ``libtorch_cuda.so``, so it fails to load beside the CPU torch,
and torchvision's own fake-kernel registrations then raise ``operator torchvision::nms does
not exist`` at import. clinicadl needs torchvision (its model definitions), and Lightning
imports it through torchmetrics, so without this every Lightning test would fail once
clinicadl's requirements are installed.

``.ci/run`` copies this module into the virtual environment with a ``.pth`` line that
imports it at start-up. It only adds a finder: when ``torchvision`` is first imported under
a CPU torch, it declares the two operator schemas torchvision's Python side registers kernels
for (``nms``, ``qnms``); nothing else is touched, and with a CUDA torch it does nothing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
_KEEP: list[Any] = []  # the torch.library.Library must outlive the import


class _DeclareFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if torch.version.cuda is None:
            library = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                # declared already where a torchvision's own _C loaded
                with contextlib.suppress(RuntimeError):
                    library.define(op + SCHEMA)
            _KEEP.append(library)
        return None  # the ordinary finders load torchvision itself


sys.meta_path.insert(0, _DeclareFirst())
