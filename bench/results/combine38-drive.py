"""4 threads x get_into / get_many 4 KiB x 128 on the blocking client, against a running kvfs up."""
import os, sys, threading, time, random
import kvfs
addr = sys.argv[1]; api = sys.argv[2]; secs = float(sys.argv[3]) if len(sys.argv) > 3 else 4
c = kvfs.Client(addr)
if os.environ.get('MOST') and hasattr(c, '_into'): c._into._most = int(os.environ['MOST'])
N = 8192
keys = [f"k{i:06d}".encode() for i in range(N)]
if api == "put":
    for i in range(0, N, 128):
        c.put_many([(k, os.urandom(4096)) for k in keys[i:i+128]])
    print("put done"); sys.exit(0)
stop = time.monotonic() + secs
counts = [0]*4
def work(t):
    rnd = random.Random(t)
    region = memoryview(bytearray(128*4096)) if os.environ.get("REGION") else None
    bufs = [region[i*4096:(i+1)*4096] for i in range(128)] if region is not None else [bytearray(4096) for _ in range(128)]
    while time.monotonic() < stop:
        ks = rnd.sample(keys, 128)
        if api == "into":
            r = c.get_into(ks, bufs)
        else:
            r = c.get_many(ks)
        counts[t] += len(r)
ths = [threading.Thread(target=work, args=(t,)) for t in range(4)]
t0 = time.monotonic()
for t in ths: t.start()
for t in ths: t.join()
el=time.monotonic()-t0; cpu=sum(os.times()[:2])
comb=getattr(getattr(c, "_into", None), "combined", "-")
print(api, f"{sum(counts)/el/1e3:.1f}k keys/s cpu {cpu/sum(counts)*1e6:.2f}us/key(all) combined={comb} of {sum(counts)//128}")
c.close()
