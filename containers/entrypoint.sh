#!/bin/bash
# Start-up of an mpitrain container (installed as /usr/local/bin/mpitrain-entrypoint):
#   1. the ssh key pair, from a docker secret or a mounted volume (never from the image):
#        MPITRAIN_SSH_KEY  private key   (default /run/secrets/mpitrain_ssh_key)
#        MPITRAIN_SSH_PUB  public key    (default $MPITRAIN_SSH_KEY.pub; derived from the private
#                                         key when absent)
#        MPITRAIN_SSH_DIR  a mounted directory with id_ed25519/id_ecdsa/id_rsa(.pub) and/or
#                          authorized_keys, used when the secret is absent (default
#                          /etc/mpitrain/ssh)
#      The private key becomes root's client key (/root/.ssh/id_mpitrain), the public key root's
#      authorized key: every container of the service can log in to every other one.
#   2. fresh host keys for this container (the image has none);
#   3. the OMPI_MCA_* environment copied into OpenMPI's system parameter file, so that the orted
#      daemons mpirun starts over ssh (which do not inherit the container's environment) use the
#      same interfaces and transports as mpirun itself;
#   4. run "$@" (by default `sshd -D -e`: sshd in the foreground, logging to stderr); on SIGTERM
#      (a container stop) the mpitrain ranks in this container are asked to checkpoint and exit 75
#      before sshd stops.
set -euo pipefail

log() { echo "mpitrain-entrypoint: $*" >&2; }
die() { log "error: $*"; exit 1; }

KEY=${MPITRAIN_SSH_KEY:-/run/secrets/mpitrain_ssh_key}
PUB=${MPITRAIN_SSH_PUB:-$KEY.pub}
DIR=${MPITRAIN_SSH_DIR:-/etc/mpitrain/ssh}
PORT=${MPITRAIN_SSH_PORT:-22}

# ---- 1. keys --------------------------------------------------------------------------------------
install -d -m 0700 /root/.ssh
private=""
if [ -r "$KEY" ]; then
  private=$KEY
else
  for k in id_ed25519 id_ecdsa id_rsa; do
    if [ -r "$DIR/$k" ]; then private=$DIR/$k; break; fi
  done
fi

authorized=""
if [ -r "$PUB" ]; then
  authorized=$(cat "$PUB")
elif [ -n "$private" ] && [ -r "$private.pub" ]; then
  authorized=$(cat "$private.pub")
fi
if [ -r "$DIR/authorized_keys" ]; then
  authorized=$(printf '%s\n%s' "$authorized" "$(cat "$DIR/authorized_keys")")
fi

if [ -n "$private" ]; then
  # Secrets arrive 0444 or 0400 and maybe owned by someone else; ssh wants 0600 and its owner.
  install -m 0600 "$private" /root/.ssh/id_mpitrain
  ssh-keygen -y -f /root/.ssh/id_mpitrain > /root/.ssh/id_mpitrain.pub \
    || die "$private is not a usable private key (a passphrase? mpirun cannot type one)"
  [ -n "$authorized" ] || authorized=$(cat /root/.ssh/id_mpitrain.pub)
  log "client key: $private ($(ssh-keygen -l -f /root/.ssh/id_mpitrain.pub | cut -d' ' -f1-2))"
else
  log "warning: no private key ($KEY or $DIR/id_*): this container cannot launch mpirun on others"
fi
authorized=$(printf '%s\n' "$authorized" | sed '/^[[:space:]]*$/d')
[ -n "$authorized" ] || die "no authorized key: create the secret (see containers/README.md):
  docker secret create mpitrain_ssh_key ./mpitrain_ssh_key
or mount a directory with id_ed25519 / authorized_keys at $DIR"
printf '%s\n' "$authorized" > /root/.ssh/authorized_keys
chmod 0600 /root/.ssh/authorized_keys
touch /root/.ssh/known_hosts && chmod 0600 /root/.ssh/known_hosts

# With UsePAM no, sshd refuses every login to a locked account ('!' in /etc/shadow), keys included.
# '*' keeps password logins impossible and key logins possible.
if [ -w /etc/shadow ] && grep -q '^root:!' /etc/shadow; then
  usermod -p '*' root
fi

# ---- 2. host keys: new ones for every container -----------------------------------------------------
rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
ssh-keygen -q -t ed25519 -N '' -C "root@$(hostname)" -f /etc/ssh/ssh_host_ed25519_key
log "host key: $(ssh-keygen -l -f /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f1-2)"

if [ "$PORT" != 22 ]; then
  echo "Port $PORT" > /etc/ssh/sshd_config.d/05-mpitrain-port.conf
  printf 'Host *\n    Port %s\n' "$PORT" > /etc/ssh/ssh_config.d/05-mpitrain-port.conf
fi
# Sessions that log in over ssh (a person running mpirun from there) get OpenMPI's root consent.
{
  echo "SetEnv OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
} > /etc/ssh/sshd_config.d/20-mpitrain-env.conf
mkdir -p /run/sshd

# ---- 3. OpenMPI parameters for the daemons ssh starts -------------------------------------------
conf=/etc/openmpi/openmpi-mca-params.conf
if [ -d /etc/openmpi ]; then
  begin='# >>> mpitrain-entrypoint: from the container environment'
  end='# <<< mpitrain-entrypoint'
  [ -f "$conf" ] || : > "$conf"
  sed -i "/^$begin\$/,/^$end\$/d" "$conf"
  # Debian's file lacks a final newline: without one the block would extend its last line.
  if [ -s "$conf" ] && [ -n "$(tail -c 1 "$conf")" ]; then echo >> "$conf"; fi
  {
    echo "$begin"
    env | LC_ALL=C sort | sed -n 's/^OMPI_MCA_\([A-Za-z0-9_]*\)=\(.*\)$/\1 = \2/p'
    echo "$end"
  } >> "$conf"
  params=$(env | grep -c '^OMPI_MCA_' || true)
  log "$params OpenMPI parameter(s) from OMPI_MCA_* written to $conf"
fi

# ---- what this container is -------------------------------------------------------------------------
if command -v ip > /dev/null; then
  log "$(hostname): $(ip -4 -o addr show scope global | awk '{printf "%s %s  ", $2, $4}')"
fi

# ---- 4. run "$@" (sshd); a container stop checkpoints the training first ---------------------------
# `docker stop`, a swarm task shutdown or a node drain sends SIGTERM to tini (PID 1), which passes it
# here. Were sshd PID 1's only child, the container would end at once and the kernel would SIGKILL
# its ranks mid-step. Instead every mpitrain rank in this container gets SIGTERM: at the end of its
# step the whole job (ranks in other containers too) agrees to stop, writes one checkpoint and exits
# 75; this script waits for the ranks and for the launcher and daemons that serve them (mpirun,
# orted/prted: mpirun's exit code 75 reaches whoever started it) and only then stops sshd. The
# container's stop grace period must cover one step plus one checkpoint write (stack.yml sets
# stop_grace_period; `docker stop -t SECONDS` for plain containers): when it runs out Docker
# SIGKILLs everything, and the newest complete checkpoint is the previous one.
"$@" &
main=$!
job_processes() { pgrep -x 'mpitrain|mpirun|orterun|prterun|prte|orted|prted' || true; }
on_stop() {
  trap '' TERM INT
  local ranks
  ranks=$(pgrep -x mpitrain || true)
  if [ -n "$ranks" ]; then
    log "$1: SIGTERM to $(echo $ranks | wc -w) mpitrain rank(s) in this container: the job checkpoints and exits 75"
    kill -TERM $ranks 2> /dev/null || true
    local t0=$SECONDS
    while [ -n "$(job_processes)" ]; do sleep 0.2; done
    log "the job's processes here exited $((SECONDS - t0)) s after $1"
  fi
  kill -TERM "$main" 2> /dev/null || true
}
trap 'on_stop SIGTERM' TERM
trap 'on_stop SIGINT' INT
status=0
while :; do
  wait "$main" && status=0 || status=$?
  kill -0 "$main" 2> /dev/null || break  # a trapped signal ended `wait` early: wait again
done
exit "$status"
