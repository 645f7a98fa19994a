#!/bin/bash
# Writes an OpenMPI hostfile naming every task of a swarm service, from the service's task DNS
# name (tasks.<service>, answered by Docker's embedded DNS with one address per running task:
# the name <service> alone is the service VIP, or with endpoint_mode dnsrr one of the tasks).
#
#   make-hostfile.sh [-s SERVICE] [-n TASKS] [-S SLOTS] [-t SECONDS] [-o FILE] [--no-ssh]
#
#   -s SERVICE  service name as the network knows it (default $MPITRAIN_SERVICE, else mpitrain;
#               a stack's services answer to their short name and to <stack>_<name>)
#   -n TASKS    wait until exactly this many tasks resolve (default $MPITRAIN_TASKS; 0 = take
#               what resolves once two looks 2 s apart agree)
#   -S SLOTS    slots=N per task: the ranks one container runs, e.g. its GPUs (default
#               $MPITRAIN_SLOTS, else 1)
#   -t SECONDS  give up after this long (default 120)
#   -o FILE     hostfile to write (default ./hosts; - = standard output)
#   --no-ssh    do not wait for the tasks' sshd nor refresh their host keys
#
# Unless --no-ssh, it then waits until every task answers on ssh, replaces the tasks' entries in
# ~/.ssh/known_hosts with their current host keys (a replaced task may reuse an address with a
# new key, which ssh would refuse) and checks that a key login works, so that mpirun neither
# prompts nor fails on the first connection. Exit status: 0 written, 1 timed out or failed.
set -euo pipefail

service=${MPITRAIN_SERVICE:-mpitrain}
tasks=${MPITRAIN_TASKS:-0}
slots=${MPITRAIN_SLOTS:-1}
timeout=120
out=hosts
check_ssh=1

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
  case $1 in
    -s) service=$2; shift 2 ;;
    -n) tasks=$2; shift 2 ;;
    -S) slots=$2; shift 2 ;;
    -t) timeout=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    --no-ssh) check_ssh=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "make-hostfile: unknown argument '$1'" >&2; usage ;;
  esac
done
for v in "$tasks" "$slots" "$timeout"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "make-hostfile: '$v' is not a number" >&2; exit 2; }
done
[ "$slots" -ge 1 ] || { echo "make-hostfile: slots must be >= 1" >&2; exit 2; }

log() { echo "make-hostfile: $*" >&2; }
deadline=$((SECONDS + timeout))

# IPv4 addresses of the running tasks, one a line, in numeric order.
resolve() {
  getent ahostsv4 "tasks.$service" 2>/dev/null | awk '{print $1}' \
    | sort -u -t. -k1,1n -k2,2n -k3,3n -k4,4n || true
}

# ---- 1. wait for the tasks to resolve -------------------------------------------------------------
addrs=""
previous=""
while :; do
  addrs=$(resolve)
  n=$(printf '%s' "$addrs" | grep -c . || true)
  if [ "$tasks" -gt 0 ]; then
    [ "$n" -eq "$tasks" ] && break
  elif [ "$n" -gt 0 ] && [ "$addrs" = "$previous" ]; then
    break
  fi
  previous=$addrs
  if [ $SECONDS -ge $deadline ]; then
    log "timed out after ${timeout}s: tasks.$service resolves to $n address(es)$([ "$tasks" -gt 0 ] && echo ", expected $tasks")"
    [ -n "$addrs" ] && log "resolved: $(echo $addrs)"
    log "is the service running with endpoint_mode dnsrr on this container's network? (docker service ps)"
    exit 1
  fi
  sleep 2
done
log "tasks.$service: $n task(s): $(echo $addrs)"

# ---- 2. ssh: host keys and a key login on every task ---------------------------------------------
if [ "$check_ssh" -eq 1 ]; then
  port=$(ssh -G localhost 2>/dev/null | awk '$1 == "port" {print $2}')
  known=${HOME:-/root}/.ssh/known_hosts
  mkdir -p "$(dirname "$known")" && touch "$known"
  for a in $addrs; do
    while :; do
      scanned=$(ssh-keyscan -T 5 -p "${port:-22}" "$a" 2>/dev/null | grep -v '^#' || true)
      [ -n "$scanned" ] && break
      if [ $SECONDS -ge $deadline ]; then log "timed out waiting for sshd on $a"; exit 1; fi
      sleep 1
    done
    ssh-keygen -R "$a" -f "$known" > /dev/null 2>&1 || true
    [ "${port:-22}" = 22 ] || ssh-keygen -R "[$a]:$port" -f "$known" > /dev/null 2>&1 || true
    printf '%s\n' "$scanned" >> "$known"
    if ! err=$(ssh -o BatchMode=yes -o ConnectTimeout=10 "$a" true 2>&1); then
      log "ssh to $a failed: $err"
      log "is the same key pair (secret mpitrain_ssh_key) given to every task?"
      exit 1
    fi
  done
  rm -f "$known.old"
  log "ssh: key login works on all $n task(s); host keys refreshed in $known"
fi

# ---- 3. the hostfile -------------------------------------------------------------------------------
text=$(
  echo "# OpenMPI hostfile: tasks.$service, $n task(s), $slots slot(s) each ($(date -u +%FT%TZ))"
  for a in $addrs; do echo "$a slots=$slots"; done
)
if [ "$out" = - ]; then
  printf '%s\n' "$text"
else
  printf '%s\n' "$text" > "$out.tmp.$$" && mv -f "$out.tmp.$$" "$out"
  log "wrote $out ($n host(s), $((n * slots)) slot(s))"
fi
