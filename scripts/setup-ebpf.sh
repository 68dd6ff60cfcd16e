#!/bin/sh
# setup-ebpf.sh - prepare this machine for ingero-capture's BCC probes. Idempotent.
#
# BCC compiles its programs at start-up against the kernel headers found in
# /lib/modules/$(uname -r)/build. When the running kernel has no headers package
# (CI VMs, custom kernels), Debian's generic linux-headers-amd64 tree is linked there
# instead: enough for tracepoint and uprobe programs, whose layouts BCC reads from the
# running kernel's tracefs format files, not from the headers. On your own nodes install
# linux-headers-$(uname -r) instead; this script then leaves it alone.
# It also mounts tracefs at /sys/kernel/tracing when it is not mounted.
#
# Usage: sudo scripts/setup-ebpf.sh
set -eu

kver=$(uname -r)
moddir=/lib/modules/$kver
did=0

if [ "$(id -u)" != 0 ]; then
    echo "setup-ebpf: must run as root" >&2
    exit 1
fi

if [ -e "$moddir/build/include" ] && { [ ! -L "$moddir/build" ] || [ -e "$moddir/source/include/linux/kconfig.h" ]; }; then
    echo "setup-ebpf: headers present: $moddir/build -> $(readlink -f "$moddir/build")"
else
    # Newest Debian generic headers for this architecture (linux-headers-amd64 depends on it).
    arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
    hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$hdr" ]; then
        echo "setup-ebpf: no kernel headers for $kver and none in /usr/src;" \
             "install linux-headers-$kver (or linux-headers-$arch)" >&2
        exit 1
    fi
    mkdir -p "$moddir"
    # A dangling link from an earlier run is replaced, not followed.
    rm -f "$moddir/build" "$moddir/source"
    ln -s "$hdr" "$moddir/build"
    echo "setup-ebpf: linked $moddir/build -> $hdr (generic headers; kernel is $kver)"
    # Debian splits the tree: the arch part (generated config) and a -common part with
    # the bulk of include/; BCC looks for the latter through source/.
    common="${hdr%-"$arch"}-common"
    if [ -d "$common" ]; then
        ln -s "$common" "$moddir/source"
        echo "setup-ebpf: linked $moddir/source -> $common"
    fi
    did=1
fi

if [ -e /sys/kernel/tracing/events ]; then
    echo "setup-ebpf: tracefs mounted at /sys/kernel/tracing"
else
    mount -t tracefs nodev /sys/kernel/tracing
    echo "setup-ebpf: mounted tracefs at /sys/kernel/tracing"
    did=1
fi

if [ ! -e /sys/kernel/debug/tracing ] && [ -d /sys/kernel/debug ] && \
   ! grep -q " /sys/kernel/debug " /proc/mounts; then
    # Older BCC releases look for the tracing files under debugfs.
    mount -t debugfs nodev /sys/kernel/debug 2>/dev/null && \
        echo "setup-ebpf: mounted debugfs at /sys/kernel/debug" && did=1 || true
fi

[ "$did" = 0 ] && echo "setup-ebpf: nothing to do"
exit 0
