#!/usr/bin/env bash
# fleet.sh: check, or copy and check, that every host of an OpenMPI hostfile has what
# `mpirun -hostfile HOSTFILE BINARY CONFIG` needs there: the same binary, config and data shards at
# the same paths, room for checkpoints, and how many GPUs. For clusters without a shared
# filesystem; hostfiles/README.md ("Without a shared filesystem: fleet.sh") has the details.
#
#   fleet.sh check HOSTFILE --binary PATH --config PATH [--data GLOB_OR_DIR ...] [options]
#   fleet.sh copy  HOSTFILE --binary PATH --config PATH [--data GLOB_OR_DIR ...] [--dest DIR] [options]
#
# Remote hosts are reached with pdsh/pdcp over ssh (`-R ssh`, all hosts in parallel, bounded by
# connect and command timeouts); the launching host, when it is in the hostfile, is checked
# directly, as mpirun starts its ranks without ssh. Exit 0: every host fine; 1: some host is not
# (the table says which and why); 2: bad usage or a missing local tool (one line on stderr).
set -u -o pipefail

PROG=fleet.sh
usage_text() {
  cat <<'EOF'
usage: fleet.sh check HOSTFILE --binary PATH --config PATH [--data GLOB_OR_DIR ...] [options]
       fleet.sh copy  HOSTFILE --binary PATH --config PATH [--data GLOB_OR_DIR ...] [--dest DIR] [options]

check  compares every host of HOSTFILE with this one: reachable over ssh, the same binary and
       config (sha256), the data shards (sizes; --hash-data: sha256), free space where
       checkpoint.dir is (or would be created), GPUs (nvidia-smi -L). Exit 0 when every host is
       fine, 1 otherwise, 2 on bad usage.
copy   copies what differs or is missing to every host with pdcp (pdsh must be installed on
       every host), at the same absolute paths (or flat under --dest DIR), then runs check.

options:
  --data GLOB_OR_DIR ...  shards as mpitrain takes them (a file, a directory's *.h5, a glob);
                          default: data.train and data.val of the config
  --checkpoint-dir DIR    default: checkpoint.dir of the config (else "checkpoints")
  --min-free-gb N         fail a host with less than N GB free there (default 0: report only)
  --hash-data             compare the shards' sha256 instead of their sizes (reads every shard)
  --dest DIR              the copies are DIR/<file name> (check: look for them there)
  -F SSH_CONFIG           ssh configuration file for pdsh/pdcp
Relative paths (also those in the config) are taken from the current directory: run it where
you run mpirun. Environment: FLEET_SSH_ARGS (more ssh options), FLEET_CONNECT_TIMEOUT (10 s),
FLEET_COMMAND_TIMEOUT (300 s per host), FLEET_FANOUT (32 hosts at a time).
EOF
}
die_usage() { echo "$PROG: $1 (fleet.sh --help)" >&2; exit 2; }

# ---- arguments --------------------------------------------------------------------------------

[ $# -ge 1 ] || die_usage "missing command: check or copy"
case $1 in
  -h|--help) usage_text; exit 0 ;;
  check|copy) CMD=$1; shift ;;
  *) die_usage "unknown command '$1' (check or copy)" ;;
esac
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then die_usage "$CMD: missing HOSTFILE"; fi
HOSTFILE=$1
shift

BINARY="" CONFIG="" CKPT_DIR="" DEST="" MIN_FREE_GB=0 HASH_DATA=0 SSH_CONFIG=""
DATA_ARGS=()
need_value() { if [ $# -lt 2 ] || [ -z "$2" ]; then die_usage "$1 needs a value"; fi; }
while [ $# -gt 0 ]; do
  case $1 in
    --binary) need_value "$@"; BINARY=$2; shift 2 ;;
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --checkpoint-dir) need_value "$@"; CKPT_DIR=$2; shift 2 ;;
    --dest) need_value "$@"; DEST=$2; shift 2 ;;
    --min-free-gb) need_value "$@"; MIN_FREE_GB=$2; shift 2 ;;
    -F) need_value "$@"; SSH_CONFIG=$2; shift 2 ;;
    --hash-data) HASH_DATA=1; shift ;;
    --data)
      shift
      if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then die_usage "--data needs a file, directory or glob"; fi
      while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do DATA_ARGS+=("$1"); shift; done ;;
    -h|--help) usage_text; exit 0 ;;
    *) die_usage "$CMD: unknown argument '$1'" ;;
  esac
done
[ -n "$BINARY" ] || die_usage "$CMD: --binary PATH is required"
[ -n "$CONFIG" ] || die_usage "$CMD: --config PATH is required"
readable() { [ -f "$1" ] && [ -r "$1" ]; }
readable "$HOSTFILE" || die_usage "no such hostfile: $HOSTFILE"
readable "$BINARY" || die_usage "--binary: no such readable file: $BINARY"
readable "$CONFIG" || die_usage "--config: no such readable file: $CONFIG"
[[ $MIN_FREE_GB =~ ^[0-9]+(\.[0-9]+)?$ ]] || die_usage "--min-free-gb wants a number of GB, got '$MIN_FREE_GB'"
[ -z "$SSH_CONFIG" ] || [ -r "$SSH_CONFIG" ] || die_usage "-F: no such file: $SSH_CONFIG"
[ -z "$DEST" ] || [ "${DEST#/}" != "$DEST" ] || die_usage "--dest wants an absolute path, got '$DEST'"
CONNECT_T=${FLEET_CONNECT_TIMEOUT:-10}
CMD_T=${FLEET_COMMAND_TIMEOUT:-300}
FANOUT=${FLEET_FANOUT:-32}
[[ $CONNECT_T =~ ^[1-9][0-9]*$ ]] || die_usage "FLEET_CONNECT_TIMEOUT must be a positive integer, got '$CONNECT_T'"
[[ $CMD_T =~ ^[1-9][0-9]*$ ]] || die_usage "FLEET_COMMAND_TIMEOUT must be a positive integer, got '$CMD_T'"
[[ $FANOUT =~ ^[1-9][0-9]*$ ]] || die_usage "FLEET_FANOUT must be a positive integer, got '$FANOUT'"

# ---- the hostfile: first word of each line; comments, blank lines and repeats dropped ----------

HOSTS=()
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%%#*}
  read -r h _ <<< "$line"
  [ -n "${h:-}" ] || continue
  case $h in *[],[]*) die_usage "$HOSTFILE: host '$h': commas and brackets are not supported" ;; esac
  dup=0
  for x in "${HOSTS[@]}"; do [ "$x" = "$h" ] && dup=1; done
  [ $dup -eq 0 ] && HOSTS+=("$h")
done < "$HOSTFILE"
[ ${#HOSTS[@]} -gt 0 ] || die_usage "$HOSTFILE lists no host"

# ---- the config's data and checkpoint paths (the YAML forms `key: value`, `key: [a, b]` and a
# block list of `- a` lines under the key; anything else: give --data / --checkpoint-dir) ---------

yaml_values() {  # section key file: prints the values, one a line; exit 3 for an unread form
  awk -v sec="$1" -v key="$2" '
    function unquote(s) {
      sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s)
      if (s ~ /^".*"$/ || s ~ /^\047.*\047$/) s = substr(s, 2, length(s) - 2)
      return s
    }
    function nocomment(s) { sub(/(^|[ \t])#.*$/, "", s); return s }
    /^[^ \t#]/ { insec = ($0 ~ ("^" sec ":[ \t]*(#.*)?$")); inlist = 0; next }
    !insec { next }
    inlist && /^[ \t]+-[ \t]/ { v = nocomment($0); sub(/^[ \t]+-[ \t]+/, "", v); print unquote(v); next }
    inlist && /^[ \t]*(#.*)?$/ { next }
    { inlist = 0 }
    $0 ~ ("^[ \t]+" key ":") {
      v = nocomment($0); sub("^[ \t]+" key ":", "", v); v = unquote(v)
      if (v == "") { inlist = 1; next }
      if (v ~ /^\[/) {
        if (v !~ /\]$/) bad = 1
        v = substr(v, 2, length(v) - 2)
        n = split(v, parts, ",")
        for (i = 1; i <= n; i++) if (unquote(parts[i]) != "") print unquote(parts[i])
        next
      }
      if (v ~ /^[{|>]/) { bad = 1; next }
      print v
    }
    END { exit bad ? 3 : 0 }' "$3"
}

# mpitrain's expansion of one data.train/val entry (src/data/shards.cpp): a directory gives its
# *.h5 files, a file itself, anything else is a glob; regular files only. Also sent to the hosts.
fleet_expand() {
  local p=$1 f
  case $p in \~/*) p=$HOME/${p#\~/} ;; esac
  if [ -d "$p" ]; then
    for f in "$p"/*.h5; do [ -f "$f" ] && printf '%s\n' "$f"; done
  elif [ -f "$p" ]; then
    printf '%s\n' "$p"
  else
    while IFS= read -r f; do [ -f "$f" ] && printf '%s\n' "$f"; done < <(compgen -G "$p")
  fi
  return 0
}

abspath() { realpath -sm -- "$1"; }   # absolute, symlinks kept (the ranks open the path as given)

PATTERNS=()
if [ ${#DATA_ARGS[@]} -gt 0 ]; then
  PATTERNS=("${DATA_ARGS[@]}")
  DATA_FROM="--data"
else
  for k in train val; do
    vals=$(yaml_values data "$k" "$CONFIG") || die_usage "$CONFIG: cannot read data.$k in this YAML form; give --data"
    while IFS= read -r v; do [ -n "$v" ] && PATTERNS+=("$v"); done <<< "$vals"
  done
  DATA_FROM="data.train/val of $CONFIG"
fi
if [ -z "$CKPT_DIR" ]; then
  CKPT_DIR=$(yaml_values checkpoint dir "$CONFIG" | head -1) || die_usage "$CONFIG: cannot read checkpoint.dir; give --checkpoint-dir"
  CKPT_DIR=${CKPT_DIR:-checkpoints}
fi
CKPT_ABS=$(abspath "$CKPT_DIR")

# The items: 0 = binary, 1 = config, then the data files. Local path, path on the hosts, size,
# sha256 (binary and config always; shards with --hash-data).
L_PATH=("$(abspath "$BINARY")" "$(abspath "$CONFIG")")
KIND=(binary config)
ABS_PATTERNS=()
for p in "${PATTERNS[@]}"; do
  case $p in \~/*) ap=$HOME/${p#\~/} ;; *) ap=$p ;; esac
  [ "${ap#/}" = "$ap" ] && ap=$PWD/$ap
  ABS_PATTERNS+=("$ap")
  n=0
  while IFS= read -r f; do
    [ -n "$f" ] || continue
    f=$(abspath "$f")
    dup=0
    for x in "${L_PATH[@]:2}"; do [ "$x" = "$f" ] && dup=1; done
    [ $dup -eq 0 ] && { L_PATH+=("$f"); KIND+=(data); }
    n=$((n + 1))
  done < <(fleet_expand "$ap")
  [ $n -gt 0 ] || die_usage "data: no shard matches '$p' here (from $DATA_FROM)"
done
N_ITEMS=${#L_PATH[@]}
N_DATA=$((N_ITEMS - 2))

R_PATH=() L_SIZE=() L_HASH=() DO_HASH=()
declare -A SEEN_BASE=()
for i in "${!L_PATH[@]}"; do
  p=${L_PATH[$i]}
  [ -r "$p" ] || die_usage "cannot read $p"
  if [ -n "$DEST" ]; then
    b=${p##*/}
    [ -z "${SEEN_BASE[$b]:-}" ] || die_usage "--dest: two files named '$b' ($p, ${SEEN_BASE[$b]})"
    SEEN_BASE[$b]=$p
    R_PATH+=("${DEST%/}/$b")
  else
    R_PATH+=("$p")
  fi
  L_SIZE+=("$(stat -Lc %s -- "$p")")
  if [ "$i" -lt 2 ] || [ "$HASH_DATA" -eq 1 ]; then
    DO_HASH+=(1)
    L_HASH+=("$(sha256sum -- "$p" | cut -d' ' -f1)")
  else
    DO_HASH+=(0)
    L_HASH+=(-)
  fi
done

# ---- which hosts are this one (checked without ssh, as mpirun starts their ranks) --------------

LOCAL_NAME=$(uname -n)
LOCAL_ADDRS=" $( (ip -o addr show 2>/dev/null || true) | awk '{ split($4, a, "/"); printf "%s ", a[1] }')"
is_local() {
  local h=${1#*@} a
  case $h in localhost|localhost.*|127.*|::1|"$LOCAL_NAME"|"${LOCAL_NAME%%.*}") return 0 ;; esac
  [[ $LOCAL_ADDRS == *" $h "* ]] && return 0
  [[ $h =~ ^[0-9.]+$ ]] && return 1      # an address that is not one of ours
  for a in $(timeout 3 getent ahosts "$h" 2>/dev/null | awk '{ print $1 }' | sort -u); do
    case $a in 127.*|::1) return 0 ;; esac
    [[ $LOCAL_ADDRS == *" $a "* ]] && return 0
  done
  return 1
}
declare -A LOCAL=()
REMOTE_HOSTS=()
for h in "${HOSTS[@]}"; do
  if is_local "$h"; then LOCAL[$h]=1; else REMOTE_HOSTS+=("$h"); fi
done

if [ ${#REMOTE_HOSTS[@]} -gt 0 ]; then
  for tool in pdsh ssh; do
    command -v "$tool" >/dev/null || die_usage "$tool not found here (Debian: apt-get install pdsh openssh-client)"
  done
  [ "$CMD" = copy ] && ! command -v pdcp >/dev/null && die_usage "pdcp not found here (Debian: apt-get install pdsh)"
fi

WORK=$(mktemp -d /tmp/fleet-XXXXXX) || { echo "$PROG: mktemp failed" >&2; exit 2; }
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ssh options for pdsh/pdcp's ssh module (PDSH_SSH_ARGS_APPEND goes before the host name).
# BatchMode: a host that would prompt fails instead of hanging; ConnectTimeout also bounds the
# banner exchange with a host that accepts the connection but never answers.
SSH_APPEND="${SSH_CONFIG:+-F $SSH_CONFIG }${FLEET_SSH_ARGS:-} -o BatchMode=yes -o ConnectTimeout=$CONNECT_T ${PDSH_SSH_ARGS_APPEND:-}"

# Runs a bash script on hosts (comma-separated) with pdsh; every output line is "host: text".
# The script travels gzip'ed and base64-encoded in the command, so any path survives the remote
# shell's quoting; it ends by calling fleet_main </dev/null (no command can eat the script).
on_hosts() {  # hosts_csv script_file out err
  local b64
  b64=$(gzip -9n < "$2" | base64 -w0)
  if [ ${#b64} -gt 120000 ]; then
    echo "$PROG: the command for the hosts is too long (${#b64} bytes; too many data files for one run)" >&2
    exit 2
  fi
  PDSH_SSH_ARGS_APPEND=$SSH_APPEND timeout -k 5 $((CONNECT_T + CMD_T + 30)) \
    pdsh -R ssh -t "$CONNECT_T" -u "$CMD_T" -f "$FANOUT" -w "$1" \
    "echo $b64 | base64 -d | gunzip | bash" > "$3" 2> "$4"
}
on_local() {  # host script_file out err: the same, run here (appends)
  timeout -k 5 "$CMD_T" bash < "$2" 2>> "$4" | sed "s|^|$1: |" >> "$3"
}

# ---- the probe each host runs: one line per finding, END last ---------------------------------

make_probe() {  # file: writes the probe script
  {
    echo 'set +e +u'
    declare -f fleet_expand
    printf 'paths=('; printf '%q ' "${R_PATH[@]}"; printf ')\n'
    printf 'hash=(%s)\n' "${DO_HASH[*]}"
    if [ -z "$DEST" ]; then
      printf 'patterns=('; printf '%q ' "${ABS_PATTERNS[@]}"; printf ')\n'
    else
      echo 'patterns=()'   # the copies are flat under --dest: the config's patterns do not apply
    fi
    printf 'ckpt=%q\n' "$CKPT_ABS"
    cat <<'EOF'
fleet_main() {
  echo "H $(uname -n)"
  local i p s h d n
  for i in "${!paths[@]}"; do
    p=${paths[$i]}
    if [ ! -e "$p" ]; then echo "F $i missing"; continue; fi
    if [ ! -f "$p" ] || [ ! -r "$p" ]; then echo "F $i unreadable"; continue; fi
    s=$(stat -Lc %s -- "$p")
    h=-
    if [ "${hash[$i]}" = 1 ]; then h=$(sha256sum -- "$p" 2>/dev/null | cut -d' ' -f1); fi
    echo "F $i $s ${h:-unreadable}"
  done
  # shared libraries the binary needs and this host lacks
  if [ -f "${paths[0]}" ] && command -v ldd >/dev/null; then
    ldd -- "${paths[0]}" 2>/dev/null | awk '/not found/ { print "L " $1 }'
  fi
  for p in "${patterns[@]}"; do
    fleet_expand "$p" | while IFS= read -r f; do echo "M $(realpath -sm -- "$f")"; done
  done
  d=$ckpt
  while [ ! -d "$d" ]; do d=$(dirname -- "$d"); done
  df -Pk -- "$d" 2>/dev/null | awk -v d="$d" 'NR == 2 { print "D " $4 " " d }'
  if command -v nvidia-smi >/dev/null; then
    if n=$(timeout 30 nvidia-smi -L 2>/dev/null); then echo "G $(grep -c '^GPU ' <<< "$n")"; else echo "G error"; fi
  else
    echo "G none"
  fi
  if command -v pdcp >/dev/null; then echo "P yes"; else echo "P no"; fi
  echo END
}
fleet_main </dev/null
EOF
  } > "$1"
}

# ---- gather: run the probe everywhere at once, parse "host: X ..." lines -----------------------

declare -A REACH UNAME FILE LIBS EXTRA FREE_KB FREE_DIR GPUS HAS_PDCP WHY
gather() {
  local probe=$WORK/probe.sh h rest tag a b
  make_probe "$probe"
  : > "$WORK/local.out"; : > "$WORK/local.err"; : > "$WORK/remote.out"; : > "$WORK/remote.err"
  for h in "${HOSTS[@]}"; do
    [ -n "${LOCAL[$h]:-}" ] || continue
    on_local "$h" "$probe" "$WORK/local.out" "$WORK/local.err"   # fast: no network
  done
  if [ ${#REMOTE_HOSTS[@]} -gt 0 ]; then
    local csv
    csv=$(IFS=,; echo "${REMOTE_HOSTS[*]}")
    on_hosts "$csv" "$probe" "$WORK/remote.out" "$WORK/remote.err"
  fi
  # pdsh prefixes a line with the host name without "user@"
  declare -A entry=()
  for h in "${HOSTS[@]}"; do
    REACH[$h]=no; LIBS[$h]=""; EXTRA[$h]=""; WHY[$h]=""
    if [ -n "${LOCAL[$h]:-}" ]; then entry[$h]=$h; else entry[${h#*@}]=$h; fi
  done
  declare -A matched=()
  while IFS= read -r line; do
    h=${entry[${line%%: *}]:-}
    rest=${line#*: }
    [ -n "$h" ] || continue
    read -r tag a b <<< "$rest"
    case $tag in
      H) UNAME[$h]=$a ;;
      F) FILE[$h,$a]=$b ;;
      L) LIBS[$h]+="${LIBS[$h]:+ }$a" ;;
      M) matched[$h,${rest#M }]=1 ;;
      D) FREE_KB[$h]=$a; FREE_DIR[$h]=$b ;;
      G) GPUS[$h]=$a ;;
      P) HAS_PDCP[$h]=$a ;;
      END) REACH[$h]=yes ;;
    esac
  done < <(cat "$WORK/local.out" "$WORK/remote.out")
  # files that the hosts' own expansion of the patterns finds but this host's does not: they
  # would change the shard list there (mpitrain then refuses to start)
  local key
  declare -A ours=()
  for p in "${R_PATH[@]:2}"; do ours[$p]=1; done
  for key in "${!matched[@]}"; do
    h=${key%%,*}
    p=${key#*,}
    [ -n "${ours[$p]:-}" ] || EXTRA[$h]+="$p"$'\n'
  done
  # why a host gave no END: the first line pdsh or ssh said about it
  for h in "${HOSTS[@]}"; do
    [ "${REACH[$h]}" = yes ] && continue
    local msg re
    re=$(sed 's/[].[*^$\/]/\\&/g' <<< "${h#*@}")
    msg=$(cat "$WORK/remote.err" "$WORK/local.err" 2>/dev/null |
      sed -n "s/^pdsh@[^:]*: $re: //p; s/^$re: //p" | grep -v '^ssh exited with exit code' | head -2 |
      paste -sd ';' | sed 's/;/; /g')
    [ -z "$msg" ] && msg=$(sed -n "s/^pdsh@[^:]*: $re: //p" "$WORK/remote.err" 2>/dev/null | head -1)
    [ -n "${UNAME[$h]:-}" ] && [ -z "$msg" ] && msg="the check did not finish there"
    WHY[$h]=${msg:-no answer}
  done
}

# ---- verdicts and the table -------------------------------------------------------------------

# ST = the state of item i on host h: ok | missing | unreadable | differs (size or sha256);
# ST_WHY = ST, for "differs" with the two sizes or hashes
item_status() {  # host item
  local v=${FILE[$1,$2]:-missing}
  case $v in missing|unreadable) ST=$v; ST_WHY=$v; return ;; esac
  if [ "${v%% *}" != "${L_SIZE[$2]}" ]; then
    ST=differs; ST_WHY="differs (size ${v%% *} there, ${L_SIZE[$2]} here)"
  elif [ "${DO_HASH[$2]}" = 1 ] && [ "${v#* }" != "${L_HASH[$2]}" ]; then
    local there=${v#* }
    ST=differs; ST_WHY="differs (same size; sha256 ${there:0:16} there, ${L_HASH[$2]:0:16} here)"
  else
    ST=ok; ST_WHY=ok
  fi
}

MIN_FREE_KB=$(awk -v g="$MIN_FREE_GB" 'BEGIN { printf "%d", g * 1048576 }')
declare -A ROW_OK DETAIL
evaluate() {  # fills the table rows (T_*), ROW_OK and DETAIL; returns the number of failed hosts
  local h i st bad=0 fails
  T_HOST=(host) T_REACH=(reachable) T_BIN=(binary) T_CONF=(config) T_DATA=(data) T_FREE=("free GB")
  T_GPU=(GPUs) T_VERDICT=(verdict)
  for h in "${HOSTS[@]}"; do
    local name=$h details="" fails=0
    [ -n "${UNAME[$h]:-}" ] && [ "${UNAME[$h]}" != "$h" ] && name="$h (${UNAME[$h]})"
    T_HOST+=("$name")
    if [ "${REACH[$h]}" != yes ]; then
      if [ -n "${UNAME[$h]:-}" ]; then T_REACH+=(error); else T_REACH+=(no); fi
      T_BIN+=(-) T_CONF+=(-) T_DATA+=(-) T_FREE+=(-) T_GPU+=(-) T_VERDICT+=(FAIL)
      DETAIL[$h]="  unreachable: ${WHY[$h]}"$'\n'
      ROW_OK[$h]=0
      bad=$((bad + 1))
      continue
    fi
    if [ -n "${LOCAL[$h]:-}" ]; then T_REACH+=("yes (local)"); else T_REACH+=(yes); fi
    for i in 0 1; do
      item_status "$h" "$i"; st=$ST
      [ "$st" = ok ] || { fails=$((fails + 1)); details+="  ${KIND[$i]} ${R_PATH[$i]}: $ST_WHY"$'\n'; }
      if [ "$i" -eq 0 ] && [ "$st" = ok ] && [ -n "${LIBS[$h]}" ]; then
        st="libs missing"
        fails=$((fails + 1))
        details+="  binary ${R_PATH[0]}: shared libraries not found there: ${LIBS[$h]}"$'\n'
      fi
      if [ "$i" -eq 0 ]; then T_BIN+=("$st"); else T_CONF+=("$st"); fi
    done
    # data: counts per kind of problem, the first three files of each named
    local nmiss=0 ndiff=0 nunread=0 nextra=0 shown=0
    for ((i = 2; i < N_ITEMS; i++)); do
      item_status "$h" "$i"; st=$ST
      case $st in
        ok) continue ;;
        missing) nmiss=$((nmiss + 1)) ;;
        differs) ndiff=$((ndiff + 1)) ;;
        unreadable) nunread=$((nunread + 1)) ;;
      esac
      shown=$((shown + 1))
      if [ $shown -le 3 ]; then
        details+="  data ${R_PATH[$i]}: $ST_WHY"$'\n'
      fi
    done
    [ $shown -gt 3 ] && details+="  ... and $((shown - 3)) more data files"$'\n'
    if [ -n "${EXTRA[$h]}" ]; then
      nextra=$(printf '%s' "${EXTRA[$h]}" | grep -c .)
      details+="  data: $nextra more file(s) there match the data patterns (the ranks would disagree on the shard list): $(printf '%s' "${EXTRA[$h]}" | head -3 | tr '\n' ' ')"$'\n'
    fi
    local dtext=""
    [ $nmiss -gt 0 ] && dtext+="${dtext:+, }$nmiss missing"
    [ $ndiff -gt 0 ] && dtext+="${dtext:+, }$ndiff differ"
    [ $nunread -gt 0 ] && dtext+="${dtext:+, }$nunread unreadable"
    [ "$nextra" -gt 0 ] && dtext+="${dtext:+, }$nextra extra"
    if [ -z "$dtext" ]; then
      dtext="ok ($N_DATA)"
    else
      fails=$((fails + 1))
    fi
    T_DATA+=("$dtext")
    # free space where checkpoints go
    local kb=${FREE_KB[$h]:-} ftext
    if [ -z "$kb" ]; then
      ftext="?"; fails=$((fails + 1)); details+="  df failed for $CKPT_ABS"$'\n'
    else
      ftext=$(awk -v k="$kb" 'BEGIN { printf "%.1f", k / 1048576 }')
      if [ "$kb" -lt "$MIN_FREE_KB" ]; then
        ftext+=" < $MIN_FREE_GB"
        fails=$((fails + 1))
        details+="  free space: $ftext GB in ${FREE_DIR[$h]} (checkpoint.dir $CKPT_ABS)"$'\n'
      fi
    fi
    T_FREE+=("$ftext")
    T_GPU+=("${GPUS[$h]:-?}")
    if [ $fails -eq 0 ]; then T_VERDICT+=(OK); ROW_OK[$h]=1; else T_VERDICT+=(FAIL); ROW_OK[$h]=0; bad=$((bad + 1)); fi
    DETAIL[$h]=$details
  done
  return $bad
}

print_table() {
  local cols=(T_HOST T_REACH T_BIN T_CONF T_DATA T_FREE T_GPU T_VERDICT) w=() c r k v m ref
  for c in "${cols[@]}"; do
    ref="${c}[@]"
    m=0
    for v in "${!ref}"; do [ ${#v} -gt "$m" ] && m=${#v}; done
    w+=("$m")
  done
  for ((r = 0; r < ${#T_HOST[@]}; r++)); do
    local out=""
    for k in "${!cols[@]}"; do
      ref="${cols[$k]}[$r]"
      [ "$k" -eq $((${#cols[@]} - 1)) ] && { out+=${!ref}; break; }
      out+=$(printf '%-*s  ' "${w[$k]}" "${!ref}")
    done
    printf '%s\n' "$out"
  done
}

human_size() { awk -v b="$1" 'BEGIN { split("B KB MB GB TB", u); i = 1; while (b >= 1024 && i < 5) { b /= 1024; i++ }; printf (i == 1 ? "%d %s" : "%.1f %s"), b, u[i] }'; }

check_hosts() {  # prints the header, the table, the details; returns 0 when every host is fine
  gather
  local total=0 i
  for ((i = 2; i < N_ITEMS; i++)); do total=$((total + L_SIZE[i])); done
  echo "fleet check: ${#HOSTS[@]} hosts from $HOSTFILE${DEST:+ (copies under $DEST)}"
  echo "  binary  ${R_PATH[0]}  sha256 ${L_HASH[0]:0:16}  $(human_size "${L_SIZE[0]}")"
  echo "  config  ${R_PATH[1]}  sha256 ${L_HASH[1]:0:16}"
  echo "  data    $N_DATA files, $(human_size "$total"), from $DATA_FROM ($([ "$HASH_DATA" -eq 1 ] && echo sha256 || echo sizes) compared)"
  echo "  checkpoint.dir $CKPT_ABS (free space there or in its nearest existing parent; minimum $MIN_FREE_GB GB)"
  echo
  evaluate
  local bad=$?
  print_table
  local h failed=()
  for h in "${HOSTS[@]}"; do
    [ "${ROW_OK[$h]}" = 1 ] && continue
    failed+=("$h")
    echo
    if [ -n "${UNAME[$h]:-}" ] && [ "${UNAME[$h]}" != "$h" ]; then echo "$h (${UNAME[$h]}):"; else echo "$h:"; fi
    printf '%s' "${DETAIL[$h]}"
  done
  echo
  if [ "$bad" -eq 0 ]; then
    echo "fleet check: OK (${#HOSTS[@]} host$([ ${#HOSTS[@]} -eq 1 ] || echo s))"
    return 0
  fi
  echo "fleet check: FAIL ($bad of ${#HOSTS[@]} hosts): ${failed[*]}"
  return 1
}

# ---- copy: what differs or is missing, by pdcp into a staging directory, then renamed ----------
# A rename leaves a running binary's inode alone (no "Text file busy") and never shows a
# half-copied file under the real name.

copy_files() {
  gather
  local h i st stage=".fleet-copy.$$"
  local targets=()             # remote hosts that get something
  for h in "${HOSTS[@]}"; do
    local n=0 names=()
    if [ "${REACH[$h]}" != yes ]; then echo "fleet copy: $h: unreachable (${WHY[$h]}), skipped"; continue; fi
    for ((i = 0; i < N_ITEMS; i++)); do
      item_status "$h" "$i"; st=$ST
      [ "$st" = ok ] && continue
      n=$((n + 1))
      names+=("${R_PATH[$i]##*/}")
    done
    if [ $n -eq 0 ]; then echo "fleet copy: $h: up to date"; continue; fi
    if [ -n "${LOCAL[$h]:-}" ]; then   # this host, under --dest: a plain copy
      for ((i = 0; i < N_ITEMS; i++)); do
        item_status "$h" "$i"; [ "$ST" = ok ] && continue
        local dst=${R_PATH[$i]}
        mkdir -p -- "${dst%/*}" && cp -p -- "${L_PATH[$i]}" "$dst.$stage" && mv -f -- "$dst.$stage" "$dst" ||
          echo "fleet copy: $h: copying ${L_PATH[$i]} to $dst failed"
      done
      echo "fleet copy: $h (local): copied $n file(s)"
      continue
    fi
    if [ "${HAS_PDCP[$h]:-no}" != yes ]; then
      echo "fleet copy: $h: pdcp is not installed there (Debian: apt-get install pdsh), skipped"
      continue
    fi
    echo "fleet copy: $h: $n file(s) to copy: $(printf '%s ' "${names[@]:0:5}")$([ $n -gt 5 ] && echo "...")"
    targets+=("$h")
  done
  [ ${#targets[@]} -eq 0 ] && return 0
  # group the files by remote directory and by the set of hosts that need them: one pdcp each
  declare -A group=()
  for ((i = 0; i < N_ITEMS; i++)); do
    local hs=""
    for h in "${targets[@]}"; do
      item_status "$h" "$i"; [ "$ST" = ok ] || hs+="${hs:+,}$h"
    done
    [ -n "$hs" ] && group["${R_PATH[$i]%/*}"$'\t'"$hs"]+="$i "
  done
  # 1. staging directories; 2. pdcp per group; 3. rename what arrived whole, drop the rest
  local prep=$WORK/prep.sh commit=$WORK/commit.sh dirs=() csv
  for key in "${!group[@]}"; do dirs+=("${key%%$'\t'*}"); done
  {
    printf 'dirs=('; printf '%q ' "${dirs[@]}"; printf ')\n'
    # shellcheck disable=SC2016  # expanded there
    printf 'fleet_main() { local d; for d in "${dirs[@]}"; do mkdir -p -- "$d/%s" || echo "cannot create $d/%s"; done; }\n' "$stage" "$stage"
    echo 'fleet_main </dev/null'
  } > "$prep"
  csv=$(IFS=,; echo "${targets[*]}")
  on_hosts "$csv" "$prep" "$WORK/prep.out" "$WORK/prep.err"
  sed 's/^/fleet copy: /' "$WORK/prep.out"
  local rc=0
  for key in "${!group[@]}"; do
    local dir=${key%%$'\t'*} hs=${key#*$'\t'} files=()
    for i in ${group[$key]}; do files+=("${L_PATH[$i]}"); done
    PDSH_SSH_ARGS_APPEND=$SSH_APPEND pdcp -R ssh -p -t "$CONNECT_T" -f "$FANOUT" -w "$hs" \
      "${files[@]}" "$dir/$stage" 2> "$WORK/pdcp.err" || rc=1
    sed 's/^/fleet copy: pdcp: /' "$WORK/pdcp.err"
  done
  {
    printf 'moves=('
    for key in "${!group[@]}"; do
      for i in ${group[$key]}; do
        printf '%q %q %q ' "${key%%$'\t'*}/$stage/${R_PATH[$i]##*/}" "${R_PATH[$i]}" "${L_SIZE[$i]}"
      done
    done
    printf ')\n'
    printf 'dirs=('; printf '%q ' "${dirs[@]}"; printf ')\n'
    cat <<EOF
fleet_main() {
  local k s d
  for ((k = 0; k < \${#moves[@]}; k += 3)); do
    s=\${moves[k]}
    [ -f "\$s" ] || continue
    if [ "\$(stat -c %s -- "\$s")" = "\${moves[k + 2]}" ]; then
      mv -f -- "\$s" "\${moves[k + 1]}" || echo "cannot rename \$s"
    else
      echo "incomplete copy of \${moves[k + 1]} dropped"; rm -f -- "\$s"
    fi
  done
  for d in "\${dirs[@]}"; do rm -rf -- "\$d/$stage"; done
}
fleet_main </dev/null
EOF
  } > "$commit"
  on_hosts "$csv" "$commit" "$WORK/commit.out" "$WORK/commit.err"
  sed 's/^/fleet copy: /' "$WORK/commit.out"
  [ $rc -eq 0 ] || echo "fleet copy: pdcp reported errors (above); the check below says what arrived"
  return 0
}

if [ "$CMD" = copy ]; then
  copy_files
  echo
fi
check_hosts
exit $?
