import sys, time, glob, os
import jax, numpy as np
import lazyckpt
import lazyckpt._staged as st
paths = sys.argv[1:]
dev = jax.devices()[0]
sh = jax.sharding.SingleDeviceSharding(dev)
for path in paths:
    for rep in range(3):
        t = time.perf_counter()
        out = lazyckpt.device_put(lazyckpt.open(path), sh)
        jax.block_until_ready(out)
        print(path, rep, f"{time.perf_counter()-t:.2f}s", flush=True)
        del out
# phase timings
import jax.numpy as jnp
t=time.perf_counter(); st._changed_patterns.__wrapped__ if hasattr(st._changed_patterns,'__wrapped__') else None
x = np.zeros((1<<30,), np.uint16)
t=time.perf_counter(); y = jax.device_put(x, dev); y.block_until_ready(); print("put 2GiB", time.perf_counter()-t)
t=time.perf_counter(); e = st._empty((8192, 131072), np.dtype(np.uint16), dev); e.block_until_ready(); print("empty first", time.perf_counter()-t)
p = jax.device_put(np.zeros((512,131072),np.uint16), dev)
t=time.perf_counter(); e = st._written(e, p, (0,0)); e.block_until_ready(); print("dus first", time.perf_counter()-t)
t=time.perf_counter(); e = st._written(e, p, (512,0)); e.block_until_ready(); print("dus second", time.perf_counter()-t)
import ml_dtypes
t=time.perf_counter(); b = st._bitcast(e, np.dtype(ml_dtypes.bfloat16)); b.block_until_ready(); print("bitcast", time.perf_counter()-t)
