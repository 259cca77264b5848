"""Which device platforms stage a shard on the host and send it in pieces, and which
adopt a filled host buffer as the shard: one table, so that a new platform is named
in one place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class Platform:
    """How arrays reach the devices of one platform."""

    staged: bool
    """Shards are staged on the host and sent in pieces within the budget
    (`lazyckpt._device.staged`), since the devices hold them and the host only
    passes them through."""
    adopts: bool
    """The devices may take a host buffer handed to them as the array itself, not a
    copy: the buffer is then the result, never filled again."""


PLATFORMS: dict[str, Platform] = {
    "cpu": Platform(staged=False, adopts=True),
    "tpu": Platform(staged=True, adopts=False),
    "gpu": Platform(staged=True, adopts=False),  # (jax names CUDA's and ROCm's "gpu")
}
"""Each platform jax names (`Device.platform`) and how its arrays are placed."""

UNKNOWN = Platform(staged=False, adopts=False)
"""A platform missing from `PLATFORMS` (a plugin's): each shard filled whole and handed
to `jax.device_put`, and never assumed to adopt host memory, so that no buffer it
may still read is filled again."""


def platform(device: Any) -> Platform:
    """How arrays reach `device` (`UNKNOWN` for a platform not in `PLATFORMS`)."""
    return PLATFORMS.get(str(getattr(device, "platform", "")), UNKNOWN)


def any_staged(devices: Iterable[Any]) -> bool:
    """Whether some of `devices` is an accelerator's whose shards are sent in pieces."""
    return any(platform(device).staged for device in devices)


def all_copy(devices: Iterable[Any]) -> bool:
    """Whether every one of `devices` copies what is sent out of host memory."""
    return not any(platform(device).adopts for device in devices)
