#!/bin/sh
# containers/runtime-packages.sh BINARY: prints, one per line, the Debian packages that own the
# shared libraries BINARY loads (ldd, each path resolved through its symlinks, so libblas.so.3
# counts as OpenBLAS's and not as the reference BLAS's). Exit 1, naming them, when a library is
# not found or no package owns it.
#
# Run where the binary runs: containers/Dockerfile's build stage runs it on the binary it has just
# compiled; with MPITRAIN_PREBUILT the machine that built the binary runs it and passes the list in
# (MPITRAIN_PREBUILT_PACKAGES), so the image needs none of the build packages to learn it.
set -eu
bin=${1:?usage: containers/runtime-packages.sh BINARY}
libs=$(ldd "$bin") || { echo "runtime-packages.sh: ldd $bin failed" >&2; exit 1; }
missing=$(printf '%s\n' "$libs" | awk '/not found/ {print $1}')
if [ -n "$missing" ]; then
  echo "runtime-packages.sh: $bin needs libraries this machine lacks: $(echo $missing)" >&2
  exit 1
fi
files=$(printf '%s\n' "$libs" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' \
        | xargs -r -n1 realpath | sort -u)
# dpkg records a file under /usr or at the root (Debian 12's merged /usr): each file is looked up
# under both names, all in one dpkg -S (one pass over dpkg's file lists, not one per library).
owners=$(for f in $files; do echo "$f"; echo "/usr$f"; echo "${f#/usr}"; done | sort -u \
         | xargs -r dpkg -S 2>/dev/null || true)
list=$(printf '%s\n' "$owners" | awk -v files="$files" '
  /^diversion by / { next }
  { n = index($0, ": "); if (n == 0) next
    split(substr($0, 1, n - 1), pkgs, ", "); path = substr($0, n + 2)
    for (i in pkgs) { sub(/:.*/, "", pkgs[i]); owned[path] = 1; pkg[pkgs[i]] = 1 } }
  END {
    nf = split(files, f, "\n"); bad = ""
    for (i = 1; i <= nf; i++) {
      p = f[i]; q = "/usr" p; r = p; sub(/^\/usr/, "", r)
      if (!(p in owned) && !(q in owned) && !(r in owned)) bad = bad " " p
    }
    if (bad != "") { print "runtime-packages.sh: no package owns:" bad > "/dev/stderr"; exit 1 }
    for (k in pkg) print k
  }') || exit 1
printf '%s\n' "$list" | sort -u
