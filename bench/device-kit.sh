#!/usr/bin/env bash
# The device kit (issue 40, section 1): what mpitrain's build needs and the lent GPU image may lack,
# as Debian 12 packages unpacked into one relocatable folder that travels with the working tree.
#
#   bench/device-kit.sh [KIT]         make KIT (default: <repo>/.device-kit, ignored by git)
#   bench/device-kit.sh --check       resolve, download and unpack into a temporary folder, check,
#                                     print the size, remove it (CI: the list still resolves)
#
# Seen on the GPU image (2026-11-22, Ubuntu 24.04): Python torch 2.11 + CUDA 13 with its CMake
# config, NCCL 2.28 in site-packages, Open MPI 4.1.6, HDF5, yaml-cpp, spdlog. Everything else
# mpitrain's CMakeLists.txt asks for is here: PCRE2 (8-bit), ISA-L, utf8proc, OpenSSL's libcrypto,
# nlohmann-json, CLI11, GoogleTest, and pkgconf (pkg-config) in case the image has none.
# Debian 12's libraries need glibc >= 2.34 at most, so they run on Ubuntu 24.04's 2.39 (Debian 13's
# would need 2.38+ symbols and were not chosen).
#
# Layout of KIT:
#   usr/{include,lib/x86_64-linux-gnu,share/cmake,share/pkgconfig}   the packages' files, pruned
#   bin/pkg-config     pkgconf (libexec/pkgconf) with the kit's library path, used only where the
#                      image has no pkg-config
#   env.sh             `. KIT/env.sh` exports MPITRAIN_KIT (the CMake prefix), PKG_CONFIG_PATH, PATH
#   PACKAGES           name, version and size of each package, the download date
# Relocation: .pc files say prefix=${pcfiledir}/..., the CMake package files compute their prefix
# from their own location (checked below), multiarch headers are moved up into usr/include, and
# the libraries are found by CMake through full paths (mpitrain's build RPATH names the kit's
# lib folder), so the folder works wherever it is unpacked and needs no LD_LIBRARY_PATH.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
check=0
if [ "${1:-}" = --check ]; then
  check=1
  kit=$(mktemp -d "${TMPDIR:-/tmp}/mpitrain-kit-check.XXXXXX")
  trap 'rm -rf "$kit"' EXIT
else
  kit=${1:-$repo/.device-kit}
fi
arch=x86_64-linux-gnu

# The exact list. Runtime packages are listed beside their -dev packages; the check below fails
# when a package depends on something neither listed nor on every glibc system.
PACKAGES=(
  libpcre2-dev libpcre2-8-0       # the GPT-2 pre-tokenizer regex
  libisal-dev libisal2            # CRC32C of TensorBoard records
  libutf8proc-dev libutf8proc2    # tokenizer.json's NFC
  libssl-dev libssl3              # SHA-256 of tokenizer.json (libcrypto)
  nlohmann-json3-dev              # JSON (header-only)
  libcli11-dev                    # the command line (header-only)
  libgtest-dev                    # the tests (static libgtest.a, built with the cxx11 ABI)
  pkgconf-bin libpkgconf3         # pkg-config, where the image has none
)
# Dependencies deliberately not in the kit: glibc (the image's), and what mpitrain does not use
# (PCRE2's 16/32-bit and POSIX libraries, GoogleTest's sources).
NOT_NEEDED=(libc6 libc-dev libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 googletest)

say() { echo "device-kit: $*"; }
dl=$(mktemp -d "${TMPDIR:-/tmp}/mpitrain-kit-debs.XXXXXX")
chmod 755 "$dl"  # apt's _apt user downloads into it
cleanup_dl() { rm -rf "$dl"; }
if [ $check = 1 ]; then trap 'rm -rf "$kit"; cleanup_dl' EXIT; else trap cleanup_dl EXIT; fi

names=()
for p in "${PACKAGES[@]}"; do names+=("$p"); done
say "downloading ${#names[@]} Debian $(cut -d. -f1 /etc/debian_version 2>/dev/null || echo '?') packages"
(cd "$dl" && apt-get download "${names[@]}" > download.log 2>&1) || {
  tail -n 5 "$dl/download.log"
  say "apt-get download failed (run apt-get update?)"
  exit 1
}

# Every dependency is in the kit or named in NOT_NEEDED.
missing=()
for deb in "$dl"/*.deb; do
  deps=$({ dpkg-deb -f "$deb" Depends; dpkg-deb -f "$deb" Pre-Depends; } | tr ',' '\n' | sed -E 's/\(.*\)//; s/\|.*//; s/:any//; s/^ *//; s/ *$//' | sort -u || true)
  for d in $deps; do
    case " ${PACKAGES[*]} ${NOT_NEEDED[*]} " in *" $d "*) ;; *) missing+=("$(dpkg-deb -f "$deb" Package) needs $d") ;; esac
  done
done
if [ ${#missing[@]} -gt 0 ]; then
  say "dependencies neither in the kit nor in NOT_NEEDED: ${missing[*]}"
  exit 1
fi

rm -rf "$kit"
mkdir -p "$kit"
: > "$kit/PACKAGES"
for deb in "$dl"/*.deb; do
  dpkg-deb -x "$deb" "$kit"
  dpkg-deb -W --showformat='${Package} ${Version} (${Installed-Size} KiB installed)\n' "$deb" >> "$kit/PACKAGES"
done
echo "downloaded $(date -u +%F) from $(apt-get indextargets --format '$(SITE)' 2>/dev/null | head -n 1)" >> "$kit/PACKAGES"

# Prune: documentation, sources, static libraries other than GoogleTest's, OpenSSL's engines and
# providers (mpitrain calls SHA-256 only), the unused PCRE2 widths' links and .pc files.
rm -rf "$kit"/usr/share/{doc,man,lintian,aclocal} "$kit"/usr/src
lib=$kit/usr/lib/$arch
rm -rf "$lib"/engines-3 "$lib"/ossl-modules
find "$lib" -maxdepth 1 -name '*.a' ! -name 'libgtest*.a' -delete
rm -f "$lib"/pkgconfig/libpcre2-{16,32,posix}.pc
find "$kit" -xtype l -delete  # links to the libraries left out
# Multiarch headers (OpenSSL's configuration.h) where -I<kit>/usr/include finds them.
if [ -d "$kit/usr/include/$arch" ]; then
  cp -a "$kit/usr/include/$arch/." "$kit/usr/include/"
  rm -rf "${kit:?}/usr/include/$arch"
fi
# pkg-config files relative to themselves (pkgconf's ${pcfiledir}).
for pc in "$lib"/pkgconfig/*.pc "$kit"/usr/share/pkgconfig/*.pc; do
  [ -f "$pc" ] || continue
  case $pc in */lib/$arch/pkgconfig/*) up='${pcfiledir}/../../..' ;; *) up='${pcfiledir}/../..' ;; esac
  sed -i -E "s|^prefix=/usr$|prefix=$up|; s|=/usr/|=$up/|; s| -I/usr/include| -I$up/include|" "$pc"
  if grep -qE '(^|[= ]|-[IL])/usr(/|$)' "$pc"; then
    say "$pc still names /usr: $(grep -E '/usr' "$pc" | head -n 1)"
    exit 1
  fi
done
# The CMake package files must compute their prefix from their own location. GoogleTest's also
# compare against the original /usr path, which only matters when the files are /usr's own.
for f in $(find "$kit" -name '*.cmake'); do
  if grep -v -E '_realOrig|PACKAGE_PREFIX_DIR "/usr"|_IMPORT_PREFIX "/usr' "$f" | grep -qE '"/usr/'; then
    say "$f names /usr outside its relocation logic"
    exit 1
  fi
done
# pkgconf needs its library, which is not in the image's search path: the binary moves out of
# usr/bin (CMake looks for pkgconf in every prefix's bin/ and would find it unrunnable there) and
# bin/pkg-config runs it with the kit's library path.
mkdir -p "$kit/bin" "$kit/libexec"
mv "$kit/usr/bin/pkgconf" "$kit/libexec/pkgconf"
rm -rf "$kit/usr/bin"
cat > "$kit/bin/pkg-config" <<'EOF'
#!/bin/sh
# pkgconf from the device kit: its library is next to it, not in the image's library path.
kit=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$kit/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$kit/libexec/pkgconf" "$@"
EOF
chmod +x "$kit/bin/pkg-config"
cat > "$kit/env.sh" <<'EOF'
# . KIT/env.sh: the kit's packages for CMake (MPITRAIN_KIT goes into CMAKE_PREFIX_PATH) and
# pkg-config; the machine's own pkg-config is kept where it has one.
MPITRAIN_KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/usr
export MPITRAIN_KIT
export PKG_CONFIG_PATH="$MPITRAIN_KIT/lib/x86_64-linux-gnu/pkgconfig:$MPITRAIN_KIT/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
command -v pkg-config > /dev/null || export PATH="$PATH:$(dirname "$MPITRAIN_KIT")/bin"
EOF

# The kit works from where it is: pkg-config through it finds every module mpitrain asks for.
(
  . "$kit/env.sh"
  PATH="$(dirname "$MPITRAIN_KIT")/bin:$PATH"
  for m in libpcre2-8 libisal libutf8proc libcrypto nlohmann_json CLI11 gtest; do
    flags=$(pkg-config --cflags --libs "$m") || { say "pkg-config cannot resolve $m"; exit 1; }
    for f in $flags; do
      case $f in -I*|-L*) [ -d "${f:2}" ] || { say "$m: ${f:2} does not exist"; exit 1; } ;; esac
    done
  done
)
size=$(du -sb "$kit" | cut -f1)
say "$kit: $(grep -c . "$kit/PACKAGES") lines in PACKAGES, $((size / 1024)) KiB ($(find "$kit" -type f | wc -l) files)"
[ $check = 1 ] && say "check passed (the kit resolves, unpacks and relocates)"
exit 0
