import sys, time, cProfile, pstats, io
import jax, numpy as np
import lazyckpt
dev = jax.devices()[0]
sh = jax.sharding.SingleDeviceSharding(dev)
jax.block_until_ready(jax.device_put(np.zeros(4), dev))  # runtime up
path = sys.argv[1]
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
out = lazyckpt.device_put(lazyckpt.open(path), sh)
jax.block_until_ready(out)
pr.disable()
print("first", time.perf_counter() - t)
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
print(s.getvalue()[:9000])
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
print(s.getvalue()[:5000])
