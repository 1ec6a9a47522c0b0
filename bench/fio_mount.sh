#!/usr/bin/env bash
# Usage: bash bench/fio_mount.sh   (root, fio and fuse3 installed; about 90 s)
# fio on the FUSE mount vs fio on a local directory vs kvfs bench, same bs/iodepth.
set -u
W=$(mktemp -d); mkdir -p $W/mnt $W/local
export KVFS_CONFIG_DIR=$W/cfg
kvfs up --data $W/data --chunkservers 3 --listen 127.0.0.1:0 --no-gc > $W/up.out 2>$W/up.err &
UP=$!
for i in $(seq 1 100); do [ -s $W/up.out ] && break; sleep 0.2; done
ADDR=$(head -1 $W/up.out); echo "cluster $ADDR"
kvfs mount $W/mnt --addr $ADDR > $W/mount.out 2>&1 &
MNT=$!
for i in $(seq 1 100); do grep -q " $W/mnt " /proc/mounts && break; sleep 0.2; done
grep " $W/mnt " /proc/mounts | head -1
common="--ioengine=psync --iodepth=1 --size=64m --runtime=5 --time_based --output-format=json"
for dir in mnt local; do
  # lay the file out once, then the read jobs
  fio --name=layout --directory=$W/$dir --filename=f --rw=write --bs=1m --size=64m --ioengine=psync --output-format=json > $W/$dir-layout.json
  for rw in read randread; do for bs in 4k 1m; do
    fio --name=$dir-$rw-$bs --directory=$W/$dir --filename=f --rw=$rw --bs=$bs $common > $W/$dir-$rw-$bs.json
    python3 -c "
import json,sys; j=json.load(open('$W/$dir-$rw-$bs.json'))['jobs'][0]['read']
print(f\"fio {'$dir':5} {'$rw':8} {'$bs':3}: IOPS={j['iops']:>10.0f}  BW={j['bw_bytes']/1e6:>8.0f} MB/s  clat p50={j['clat_ns']['percentile']['50.000000']/1e3:>8.1f} us p99={j['clat_ns']['percentile']['99.000000']/1e3:>8.1f} us\")"
  done; done
done
kvfs bench --addr $ADDR --rw=read,randread --bs=4k,1m --iodepth=1 --batch=1 --runtime=5 --time_based --size=64m --no-progress --output-format=json > $W/bench.json 2>$W/bench.err
python3 -c "
import json; d=json.load(open('$W/bench.json'))
for j in d['jobs']:
    r=j['read']; print(f\"kvfs bench {j['jobname']:24}: IOPS={r['iops']:>10.0f}  BW={r['bw_bytes']/1e6:>8.0f} MB/s  clat p50={r['clat_ns']['percentile']['50.000000']/1e3:>8.1f} us p99={r['clat_ns']['percentile']['99.000000']/1e3:>8.1f} us\")"
kvfs umount $W/mnt; wait $MNT; kill -INT $UP; wait $UP
echo done
