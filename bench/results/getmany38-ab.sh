#!/usr/bin/env bash
# alternating pairs: A=/work/main (change), B=/work/wt/final (before); BS/BATCH/SIZE; ROUNDS
R=${ROUNDS:-3}
for r in $(seq $R); do for t in A B; do
  d=$([ $t = A ] && echo /work/main || echo /work/wt/final)
  (cd /tmp && $d/.venv/bin/kvfs bench --fsync never --rw randread --bs $BS --batch $BATCH --iodepth 2 --size $SIZE --api get_many,get_into --client async,sync --runtime 3 --time-based --no-progress --cpu --json-out /tmp/abb-$t.json > /tmp/abb-$t.txt 2>&1)
  python3 - $t <<'PY'
import json,sys,re
t=sys.argv[1]; d=json.load(open(f"/tmp/abb-{t}.json")); txt=open(f"/tmp/abb-{t}.txt").read()
cpus=re.findall(r"client=[0-9.e+]+us/key ([0-9.]+)s/GB", txt)
out=[]
for i,j in enumerate(d["jobs"]):
    name=re.sub(r"randread-[0-9a-z]+-b[0-9]+-?","",j['jobname']) or "many"
    out.append(f"{name} {j['read']['bw_bytes']/1e6:.0f}MB/s c{cpus[i] if i<len(cpus) else '?'}s/GB")
print(t, " | ".join(out), flush=True)
PY
done; done
