"""Which NVML devices a job uses: enumeration (whole GPUs and MIG instances) and the
mapping of ``CUDA_VISIBLE_DEVICES`` and reported UUIDs to them.

NVML spells a whole GPU's UUID ``GPU-…`` and a MIG instance's ``MIG-…``; CUDA accepts
either in ``CUDA_VISIBLE_DEVICES``, and a training process may report a MIG instance with
either prefix (older markers always wrote ``GPU-``). So UUIDs are compared by their hex
part (``uuid_key``) and a MIG instance is matched whichever prefix names it. The old
``MIG-GPU-<uuid>/<gi>/<ci>`` form names a whole GPU's instance by position and is not
resolved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NvmlDevice:
    """One device NVML lists: a whole GPU (``index`` is its NVML index) or a MIG instance
    (``index`` None, ``parent`` the whole GPU's handle, ``parent_uuid`` its UUID)."""

    index: int | None
    uuid: str
    handle: Any
    parent: Any = None
    parent_uuid: str | None = None


def uuid_key(uuid: str) -> str:
    """The part of a UUID that identifies the device: no ``GPU-``/``MIG-``, lower case."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


def text(value: str | bytes) -> str:
    """pynvml returns str or bytes depending on the version."""
    return value.decode() if isinstance(value, bytes) else value


def list_devices(api: Any) -> list[NvmlDevice]:
    """nvmlInit, then every device that answers: whole GPUs, and the MIG instances of
    GPUs in MIG mode (a GPU whose MIG calls fail is listed whole)."""
    api.nvmlInit()
    devices = []
    for index in range(api.nvmlDeviceGetCount()):
        try:
            handle = api.nvmlDeviceGetHandleByIndex(index)
            uuid = text(api.nvmlDeviceGetUUID(handle))
        except Exception:
            continue  # a device that does not answer at start is not ours to sample
        devices.append(NvmlDevice(index, uuid, handle))
        devices += _mig_instances(api, handle, uuid)
    return devices


def _mig_instances(api: Any, handle: Any, uuid: str) -> list[NvmlDevice]:
    try:
        current, _pending = api.nvmlDeviceGetMigMode(handle)
        if current != api.NVML_DEVICE_MIG_ENABLE:
            return []
        count = api.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:  # no MIG support (NotSupported), an old driver: a whole GPU
        return []
    instances = []
    for slot in range(count):
        with contextlib.suppress(Exception):  # NotFound: an empty slot
            mig = api.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            instances.append(NvmlDevice(None, text(api.nvmlDeviceGetUUID(mig)), mig, handle, uuid))
    return instances


def match_uuid(entry: str, known: Iterable[str]) -> str | None:
    """The one known UUID that ``entry`` (a UUID or a unique prefix of one, ``GPU-`` or
    ``MIG-`` optional and interchangeable) names, else None."""
    key = uuid_key(entry)
    if not key:
        return None
    hits = [uuid for uuid in known if uuid_key(uuid).startswith(key)]
    return hits[0] if len(hits) == 1 else None


def resolve_visible_devices(visible_devices: str | None, devices: list[NvmlDevice]) -> list[str]:
    """UUIDs of the devices that ``CUDA_VISIBLE_DEVICES`` makes visible, in CUDA order.

    Entries are NVML indices of whole GPUs or UUIDs (``GPU-…``, ``MIG-…`` or a unique
    prefix; the prefix may be left out). As CUDA does, the list ends at the first entry
    that names no device; duplicates are dropped; an empty string means none; None means
    every whole GPU. Indices are NVML (PCI bus) indices, which is CUDA's order only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs; the UUIDs the training process
    reports through ``NvmlSampler.add_uuids`` settle it.
    """
    whole = {d.index: d.uuid for d in devices if d.index is not None}
    if visible_devices is None:
        return [whole[i] for i in sorted(whole)]
    everything = [d.uuid for d in devices]
    chosen: list[str] = []
    for entry in (e.strip() for e in visible_devices.split(",")):
        uuid = whole.get(int(entry)) if entry.isdigit() else match_uuid(entry, everything)
        if uuid is None:
            break
        if uuid not in chosen:
            chosen.append(uuid)
    return chosen
