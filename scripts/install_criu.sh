#!/usr/bin/env bash
# Install criu 4.x, the version that works on recent kernels (3.x fails `criu check` on 6.x: "vdso:
# Unexpected rt vDSO area bounds"). The runtime looks for $THAWLLM_CRIU, then /opt/thawllm-criu/bin/criu,
# then `criu` on PATH (snapshots/criu.py).
#
#   install_criu.sh                      install (root); quick no-op when a criu >= 4 is already there
#   install_criu.sh --from DIR           install from .debs fetched earlier (a machine without Debian's mirror)
#   install_criu.sh --download-only DIR  only fetch the .debs into DIR (to carry to another machine)
#
# The .debs come from $DEBIAN_MIRROR, else the Debian archive this system's apt uses on Debian, else (Ubuntu,
# whose mirrors carry no Debian suite) deb.debian.org. Without network, fetch them elsewhere with
# --download-only and install --from them (the Dockerfile does when the build context has .debs/).
# Where apt's own criu is 4.x or newer, that package is installed. Otherwise (Debian bookworm, Ubuntu 24.04)
# criu and its libraries, glibc included, are fetched from Debian trixie with `apt-get download` against a
# private apt state (the system's sources are left alone: installing trixie's criu with apt would upgrade
# the system's glibc) and unpacked with `dpkg -x` into a private prefix; a wrapper runs the binary through
# that prefix's own dynamic loader.
set -euo pipefail

PREFIX=${CRIU_PREFIX:-/opt/thawllm-criu}
SUITE=trixie
ARCH=$(dpkg --print-architecture)
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")
# criu and every library it loads, glibc included (checked with ldd on the result)
PACKAGES="criu libprotobuf-c1 libnl-3-200 libnet1 libgnutls30t64 libnftables1 libbsd0 libcap2 libuuid1
libunistring5 libidn2-0 libp11-kit0 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10 libffi8 libxtables12
libjansson4 libmnl0 libnftnl11 libmd0 libedit2 libbpf1 libelf1t64 zlib1g libzstd1 libtinfo6 libc6"

say() { echo "install_criu: $*"; }
die() { echo "install_criu: $*" >&2; exit 1; }

major_of() {  # "Version: 4.1.1" -> 4 (0 when criu does not run)
    "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9]*\).*/\1/p' | head -n1 | grep . || echo 0
}

debian_mirror() {  # $DEBIAN_MIRROR, else on Debian the archive its apt already uses, else Debian's own
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    if ! grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then echo "http://deb.debian.org/debian"; return; fi
    { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}'
      sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\).*/\2/p' /etc/apt/sources.list 2>/dev/null || true
    } | awk '!/security/ && NF && !found {print; found = 1}'
}

download_debs() {  # DIR: trixie's criu and libraries as .deb files
    local dest=$1 state mirror
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || die "no Debian archive in this system's apt sources: set DEBIAN_MIRROR, or install --from DIR"
    mkdir -p "$dest"
    state=$(mktemp -d)
    chmod 755 "$state"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    if [ ! -f "$keyring" ]; then  # Ubuntu packages Debian's keyring too
        apt-get update -qq && apt-get install -y -qq --no-install-recommends debian-archive-keyring >/dev/null
    fi
    mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
    echo "deb [arch=$ARCH signed-by=$keyring] $mirror $SUITE main" > "$state/sources.list"
    local apt_opts=(-o "Dir::Etc::SourceList=$state/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
                    -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache"
                    -o "APT::Architecture=$ARCH" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
    say "fetching criu from Debian $SUITE into $dest"
    apt-get "${apt_opts[@]}" update -qq
    (cd "$dest" && apt-get "${apt_opts[@]}" download -qq $PACKAGES)
    rm -rf "$state"
    ls "$dest"/criu_4*.deb >/dev/null 2>&1 || die "no criu 4.x .deb in $dest"
}

install_prefix() {  # DIR of .debs -> $PREFIX/root, $PREFIX/bin/criu
    local debs=$1 tmp="$PREFIX.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp/root" "$tmp/bin"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" "$tmp/root"; done
    local lib="$PREFIX/root/usr/lib/$MULTIARCH" loader
    loader=$(cd "$tmp/root/usr/lib/$MULTIARCH" && ls ld-linux-*.so.* | head -n1)
    # The loader path is fixed at install time, so the wrapper runs wherever it is called from.
    cat > "$tmp/bin/criu" <<EOF
#!/bin/sh
# criu 4.x from Debian $SUITE, run with its own glibc (install_criu.sh)
exec "$lib/$loader" --library-path "$lib" "$PREFIX/root/usr/sbin/criu" "\$@"
EOF
    chmod 755 "$tmp/bin/criu"
    rm -rf "$PREFIX"
    mv "$tmp" "$PREFIX"  # into place in one rename: an interrupted install leaves no half prefix
}

FROM=""
case "${1:-}" in
    --download-only) [ -n "${2:-}" ] || die "--download-only needs a directory"; download_debs "$2"; exit 0 ;;
    --from) [ -n "${2:-}" ] || die "--from needs a directory"; FROM=$2 ;;
    "") ;;
    *) die "unknown argument $1 (--download-only DIR | --from DIR)" ;;
esac

[ "$(id -u)" = 0 ] || die "must run as root"
record_version() {  # the runtime reads it instead of running `criu --version` before every restore
    "$PREFIX/bin/criu" --version | sed -n 's/^Version: *//p' > "$PREFIX/VERSION.tmp" && mv "$PREFIX/VERSION.tmp" "$PREFIX/VERSION"
}

for candidate in "$PREFIX/bin/criu" "$(command -v criu || true)"; do
    if [ -n "$candidate" ] && [ "$(major_of "$candidate")" -ge 4 ]; then
        say "criu $("$candidate" --version | sed -n 's/^Version: *//p') already at $candidate"
        [ "$candidate" != "$PREFIX/bin/criu" ] || record_version
        exit 0
    fi
done

if [ -z "$FROM" ]; then
    candidate=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *\([0-9]*\).*/\1/p')
    if [ -z "$candidate" ]; then
        apt-get update -qq
        candidate=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *\([0-9]*\).*/\1/p')
    fi
    if [ -n "$candidate" ] && [ "$candidate" -ge 4 ] 2>/dev/null; then
        say "installing criu from the distribution"
        apt-get install -y -qq --no-install-recommends criu >/dev/null
        exit 0
    fi
    FROM=$(mktemp -d)
    trap 'rm -rf "$FROM"' EXIT
    download_debs "$FROM"
fi
install_prefix "$FROM"
[ "$(major_of "$PREFIX/bin/criu")" -ge 4 ] || die "installed criu does not run: $("$PREFIX/bin/criu" --version 2>&1 | tail -n1)"
record_version
say "installed $("$PREFIX/bin/criu" --version | sed -n 's/^Version: *//p') at $PREFIX/bin/criu"
