#!/usr/bin/env bash
# alternating pairs: A=/work/main (change), B=/work/wt/final (before); ROUNDS, API
R=${ROUNDS:-4}; API=${API:-get_into,exists_many}
for r in $(seq $R); do for t in A B; do
  d=$([ $t = A ] && echo /work/main || echo /work/wt/final)
  (cd /tmp && $d/.venv/bin/kvfs bench --rw randread --bs 4k --batch 128 --iodepth 4 --size 32m --api $API --client async,sync --runtime 3 --time-based --no-progress --cpu --json-out /tmp/ab-$t.json > /tmp/ab-$t.txt 2>&1)
  python3 - $t <<'PY'
import json,sys,re
t=sys.argv[1]; d=json.load(open(f"/tmp/ab-{t}.json")); txt=open(f"/tmp/ab-{t}.txt").read()
cpu=dict(re.findall(r"^(\S+): \(groupid.*?client=([0-9.]+)us/key", txt, re.S|re.M))
cpus=re.findall(r"client=([0-9.]+)us/key", txt)
out=[]
for i,j in enumerate(d["jobs"]):
    out.append(f"{j['jobname'].replace('randread-4k-b128-','')} {j['read']['iops']/1e3:.1f}k c{cpus[i] if i<len(cpus) else '?'}")
print(t, " | ".join(out))
PY
done; done
