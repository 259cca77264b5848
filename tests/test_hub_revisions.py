"""Revisions of `hf://` repositories, as a user names them, against the loopback Hub
(`tests/hub_server.py`): a `revision` passed as a storage option is refused with the
path to write instead, and offline, a revision the cache lacks is named as such."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from tests.helpers import orbax_save
from tests.hub_server import HubServer, folder_files

hh = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")


def test_a_revision_in_storage_options_is_refused_with_the_path_to_write(
    hub: HubServer,
) -> None:
    old = {"w": np.zeros(4, np.float32)}
    hub.commit("org/model", {"model.safetensors": save(old)})
    hub.tag("org/model", "v1")
    hub.commit("org/model", {"model.safetensors": save({"w": np.ones(4, np.float32)})})
    hub.clear_log()
    with pytest.raises(lazyckpt.LazyTypeError) as caught:
        lazyckpt.open("hf://org/model", storage_options={"revision": "v1"})
    message = str(caught.value)
    assert "storage_options['revision'] is not read for hf:// paths" in message
    assert "hf://org/model@v1" in message
    assert isinstance(caught.value, TypeError)
    assert not hub.log  # refused before any request
    with pytest.raises(lazyckpt.LazyTypeError, match=r"hf://org/model@feature%2Fx"):
        lazyckpt.open("hf://org/model", storage_options={"revision": "feature/x"})
    # What the message says to write reads that revision.
    np.testing.assert_array_equal(lazyckpt.open("hf://org/model@v1")["w"].get(), old["w"])


def test_offline_a_revision_the_cache_lacks_is_named_with_what_to_do(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Orbax checkpoint (written by Orbax) on the Hub, its `main` downloaded; its
    tag `v2` is not in the cache."""
    params = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4)}
    hub.commit("org/jax-model", folder_files(orbax_save(tmp_path / "one", params)))
    hh.snapshot_download("org/jax-model")
    saved = orbax_save(tmp_path / "two", {"w": params["w"] * 2})
    hub.commit("org/jax-model", folder_files(saved))
    hub.tag("org/jax-model", "v2")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.clear_log()
    np.testing.assert_array_equal(lazyckpt.open("hf://org/jax-model")["w"].get(), params["w"])
    with pytest.raises(lazyckpt.CheckpointNotFoundError) as caught:
        lazyckpt.open("hf://org/jax-model@v2")
    message = str(caught.value)
    assert "HF_HUB_OFFLINE is set and the local cache holds no revision 'v2'" in message
    assert "['main']" in message  # what it does hold
    assert "hf download org/jax-model --revision v2" in message
    assert "model.safetensors.index.json" not in message
    assert not hub.log
