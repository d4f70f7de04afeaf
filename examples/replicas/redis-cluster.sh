#!/usr/bin/env bash
# A Redis Cluster of three masters and three replicas on loopback ports, for trying
# replicas on one machine (`start`), and its removal (`stop`). Production clusters span
# machines; the commands are the same with real addresses.
#
#   examples/replicas/redis-cluster.sh start [DIR] [FIRST_PORT]   # default /tmp/pk-cluster 7100
#   examples/replicas/redis-cluster.sh stop  [DIR]
#
# Needs redis-server and redis-cli on PATH (scripts/test.sh puts Redis 6.2 binaries in
# ~/.cache/pagekeeper/test-deps/bin). Prints the --tier-redis URL for pagekeeper serve.
set -euo pipefail
cmd=${1:-start}
dir=${2:-/tmp/pk-cluster}
first=${3:-7100}
ports=$(seq "$first" $((first + 5)))
case "$cmd" in
start)
    mkdir -p "$dir"
    for p in $ports; do
        redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
            --cluster-config-file "nodes-$p.conf" --cluster-node-timeout 2000 \
            --save '' --appendonly no --dir "$dir" --daemonize yes \
            --pidfile "$dir/redis-$p.pid" --logfile "$dir/redis-$p.log"
    done
    for p in $ports; do
        for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    redis-cli --cluster create $(for p in $ports; do printf '127.0.0.1:%s ' "$p"; done) \
        --cluster-replicas 1 --cluster-yes >"$dir/create.log"
    for _ in $(seq 100); do
        redis-cli -p "$first" cluster info | grep -q cluster_state:ok && break
        sleep 0.2
    done
    echo "redis+cluster://$(for p in $ports; do printf '127.0.0.1:%s,' "$p"; done | sed 's/,$//')"
    ;;
stop)
    for pid in "$dir"/redis-*.pid; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
    rm -rf "$dir"
    ;;
*)
    echo "usage: $0 start|stop [DIR] [FIRST_PORT]" >&2
    exit 2
    ;;
esac
