"""A smoke test of lazyckpt as a user installs it: run by `nox -s package` with the
interpreter of a fresh virtualenv that holds the built wheel (not the checkout), from
a folder outside the repository. It opens, loads and converts, and calls every verb
of `lazyckpt.__all__` once, so that a module the wheel lacks (one the lazy imports
load on first use) fails here.

    python tests/wheel_smoke.py [--from-checkout]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

import lazyckpt


def main() -> None:
    here = Path(lazyckpt.__file__).resolve()
    if "--from-checkout" not in sys.argv:  # (how a developer tries the script itself)
        assert "site-packages" in here.parts, f"lazyckpt imported from {here}, not the wheel"
    for name in lazyckpt.__all__:  # every lazily imported module is in the wheel
        getattr(lazyckpt, name)
    called: set[str] = set()

    def use(name: str, *args: Any, **kwargs: Any) -> Any:
        called.add(name)
        return getattr(lazyckpt, name)(*args, **kwargs)

    root = Path(tempfile.mkdtemp())
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 16), dtype=np.float32)
    tree = {
        "params": {"layers": {str(i): {"w": weight + i} for i in range(3)}},
        "step": 7,
        "fp8": weight.astype("float8_e4m3fn"),
        "scale": np.ones((1, 1), np.float32),
        "w_blocks": rng.integers(0, 256, (4, 2, 16), dtype=np.uint8),
        "w_scales": np.full((4, 2), 127, np.uint8),
    }
    path = use("save", root / "ckpt", tree)
    opened = use("open", path)
    assert opened["step"] == 7
    w = opened["params"]["layers"]["1"]["w"]
    np.testing.assert_array_equal(use("load", w), weight + 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    np.testing.assert_array_equal(np.asarray(use("device_put", w, sharding)), weight + 1)
    use("saved_shardings", mesh)
    params = use("select", opened, "params/**")
    assert len(list(use("leaves", params))) == 3
    stacked = use("stack_layers", params, "params/layers")
    assert stacked["params"]["layers"]["w"].shape == (3, 8, 16)
    assert len(use("unstack_layers", stacked, "params/layers")["params"]["layers"]) == 3
    assert use("stack", [w, w]).shape == (2, 8, 16)
    assert use("concat", [w, w]).shape == (16, 16)
    assert len(use("unstack", w)) == 8
    np.testing.assert_array_equal(use("take", w, [3, 0], axis=0).get(), (weight + 1)[[3, 0]])
    renamed = use("rename", params, [(r"^params/layers/(\d+)/", r"blocks/\1/")])
    assert "blocks" in renamed
    fp8 = use("dequantize_fp8", opened["fp8"], opened["scale"], block_size=(8, 16))
    assert fp8.shape == (8, 16)
    assert use("dequantize", {"w": w}) is not None
    assert use("dequantize_mxfp4", opened["w_blocks"], opened["w_scales"]).shape == (4, 64)
    with use("measure") as cost:
        use("load", w[0])
    assert isinstance(cost, lazyckpt.ReadCost)
    assert sum(block.size for _, _, block in use("iter_blocks", {"w": w})) == w.size
    assert use("stats", params)["params/layers/0/w"].max is not None
    assert not use("diff", opened, use("open", path))
    assert use("verify", path)
    assert "params" in str(use("summary", opened))
    hf = use("convert", path, root / "hf", to="safetensors", select="params/**")
    assert use("safetensors_metadata", hf) is not None
    np.testing.assert_array_equal(use("open", hf)["params"]["layers"]["2"]["w"].get(), weight + 2)
    plan = use("convert", path, root / "plan", dry_run=True)
    assert isinstance(plan, lazyckpt.ConversionPlan)
    manager = root / "manager"
    use("save", manager / "5" / "default", tree)
    assert use("steps", manager) == [5] and list(use("items", manager / "5")) == ["default"]
    assert use("network_options").connections > 0
    with use("malloc_tuning", False):
        use("load", w[:2])
    use("device_put", {"w": w}, sharding, broadcast=False)
    verbs = {
        name
        for name in lazyckpt.__all__
        if callable(getattr(lazyckpt, name)) and not isinstance(getattr(lazyckpt, name), type)
    }
    missing = sorted(verbs - called)
    assert not missing, f"verbs the smoke test does not call: {missing}"
    print(f"lazyckpt {lazyckpt.__version__} from {here.parent}: {len(called)} verbs ran")


if __name__ == "__main__":
    main()
