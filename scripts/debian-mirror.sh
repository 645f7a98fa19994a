#!/usr/bin/env bash
# Prints the Debian mirror this machine's apt uses for Debian 12 (bookworm): the first `deb` URI
# of a deb822 .sources file or a one-line .list entry with that suite, else deb.debian.org.
# Used to debootstrap other Debian roots (the swarm test's base image, the Debian 13 CI leg)
# from the same mirror.
set -euo pipefail
suite=${1:-bookworm}
mirror=$(
  { for f in /etc/apt/sources.list.d/*.sources; do
      [ -f "$f" ] && awk -v suite="$suite" 'BEGIN { RS = ""; FS = "\n" }
        { types = ""; uris = ""; suites = ""; enabled = "yes"
          for (i = 1; i <= NF; i++) {
            if ($i ~ /^[ \t]*#/) continue
            split($i, kv, /:[ \t]*/)
            k = tolower(kv[1]); v = substr($i, index($i, ":") + 1); gsub(/^[ \t]+/, "", v)
            if (k == "types") types = v; else if (k == "uris") uris = v
            else if (k == "suites") suites = v; else if (k == "enabled") enabled = v
          }
          if (enabled != "no" && (" " types " ") ~ / deb / && (" " suites " ") ~ (" " suite " ")) {
            split(uris, u, /[ \t]+/); print u[1]
          } }' "$f"
    done
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
      | awk -v suite="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while (i <= NF && $i !~ /\]$/) i++; if ($2 ~ /^\[/) i++
                            if ($(i + 1) == suite) print $i }'
  } | grep -E '^https?://' | head -1 || true)
echo "${mirror:-http://deb.debian.org/debian}"
