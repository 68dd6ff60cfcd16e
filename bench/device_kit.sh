#!/bin/bash
# device_kit.sh - pack what bench/bench_pytorch.py needs on a GPU machine that has
# PyTorch but no BCC, no kernel headers and no network (this workplace's device machine;
# docs/performance.md, "A real PyTorch job on a GPU machine"). Built from this Debian 12
# machine's own packages (python3-bpfcc, libbpfcc, linux-headers-amd64), into KIT
# (default .devcarry, which .git/info/exclude should list):
#
#   KIT/bcc.tar.xz      libbcc and the libraries it loads, and BCC's Python package (py/)
#   KIT/headers.tar.xz  Debian's generic kernel headers (x86 only), for /usr/src
#   KIT/whl/            this project's compiled dependencies as cp312 wheels, and click
#   KIT/setup.sh        run there first: unpacks, installs, links the headers
#
# The carried tree may hold 64 MiB. LLVM 14 links libz3 (its static analyzer) and
# libxml2 (Windows manifests, which pulls in ICU's 31 MB of data): BCC calls neither,
# so both are replaced by stand-ins that define the symbols LLVM binds to (functions
# that abort, libxml2's symbol versions), generated from LLVM's own symbol table. With
# them the kit is about 50 MB with the wheels; checked here by capturing with the kit's
# libraries first on the library path (`ldd` resolves each of them inside it; libc,
# libstdc++, libgcc_s, libz and liblzma come from the GPU machine's own system).
#
# There: bash KIT/setup.sh && python3 bench/bench_pytorch.py --capture-ld-path /tmp/bccroot/lib
set -euo pipefail

KIT=${1:-.devcarry}
LIBDIR=/usr/lib/x86_64-linux-gnu
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
rm -rf "$KIT/whl"     # wheels of other versions would be installed beside the new ones
mkdir -p "$KIT/whl" "$STAGE/lib" "$STAGE/py" "$STAGE/stub"

for f in libbcc.so.0 libbcc_bpf.so.0 libLLVM-14.so.1 libclang-cpp.so.14 libbpf.so.1 \
         libbsd.so.0 libedit.so.2 libelf.so.1 libffi.so.8 libmd.so.0 libtinfo.so.6; do
    cp -L "$LIBDIR/$f" "$STAGE/lib/"
done
cp -r /usr/lib/python3/dist-packages/bcc "$STAGE/py/"
rm -rf "$STAGE/py/bcc/__pycache__"

# the stand-ins for libz3 and libxml2, from what libLLVM binds to
objdump -T "$STAGE/lib/libLLVM-14.so.1" | awk '/\*UND\*/ && $NF ~ /^Z3_/ {print $NF}' |
    sed 's/.*/void &(void) { abort(); }/' | { echo '#include <stdlib.h>'; cat; } > "$STAGE/stub/z3.c"
objdump -T "$STAGE/lib/libLLVM-14.so.1" | awk '/\*UND\*/ && /LIBXML2_/ {print $2, $(NF-1), $NF}' |
    python3 -c '
import sys
syms = [line.split() for line in sys.stdin]
with open(sys.argv[1], "w") as c:
    c.write("#include <stdlib.h>\n")
    for kind, _, name in syms:
        c.write(f"void *{name} = 0;\n" if kind == "DO" else f"void {name}(void) {{ abort(); }}\n")
versions = {}
for _, ver, name in syms:
    versions.setdefault(ver.strip("()"), []).append(name)
base = "LIBXML2_2.4.30"
with open(sys.argv[2], "w") as m:
    m.write(base + " { global: " + " ".join(n + ";" for n in versions.pop(base)) + " local: *; };\n")
    for ver, names in versions.items():
        m.write(ver + " { global: " + " ".join(n + ";" for n in names) + " } " + base + ";\n")
' "$STAGE/stub/xml.c" "$STAGE/stub/xml.map"
gcc -shared -fPIC -O1 -Wl,-soname,libz3.so.4 -o "$STAGE/lib/libz3.so.4" "$STAGE/stub/z3.c"
gcc -shared -fPIC -O1 -Wl,-soname,libxml2.so.2 -Wl,--version-script="$STAGE/stub/xml.map" \
    -o "$STAGE/lib/libxml2.so.2" "$STAGE/stub/xml.c"
deps=$(LD_LIBRARY_PATH="$STAGE/lib" ldd "$STAGE/lib/libbcc.so.0")
if grep -q "not found" <<<"$deps"; then
    echo "device_kit: unresolved: $(grep "not found" <<<"$deps")" >&2
    exit 1
fi

tar -C "$STAGE" -cf - lib py | xz -T2 -6 > "$KIT/bcc.tar.xz"
# the generic flavour (not -cloud-amd64 or -rt-amd64), x86 alone of the architectures
hdr=$(ls -d /usr/src/linux-headers-*[0-9]-amd64 | sort -V | tail -n 1)
common="${hdr%-amd64}-common"
tar -C /usr/src -cf - --exclude="$(basename "$common")/arch/[a-wyz]*" \
    --exclude="$(basename "$common")/arch/x[!8]*" \
    "$(basename "$hdr")" "$(basename "$common")" | xz -T2 -6 > "$KIT/headers.tar.xz"

# this project's compiled dependencies, in the versions the development venv holds
PIP=${PIP:-.venv/bin/python -m pip}
for pkg in apsw zstandard orjson; do
    ver=$($PIP show "$pkg" | awk '/^Version/ {print $2}')
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$KIT/whl" "$pkg==$ver"
done
$PIP download -q --no-deps --only-binary=:all: -d "$KIT/whl" \
    "click==$($PIP show click | awk '/^Version/ {print $2}')"

cat > "$KIT/setup.sh" <<'EOF'
#!/bin/bash
# Unpack the kit on the GPU machine (as root), from the repository's root.
set -eu
KIT=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/bccroot /tmp/site
tar -xJf "$KIT/bcc.tar.xz" -C /tmp/bccroot
tar -xJf "$KIT/headers.tar.xz" -C /usr/src
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$KIT"/whl/*.whl
bash scripts/setup-ebpf.sh
echo "export PYTHONPATH=$PWD:/tmp/site INGERO_BCC_PATH=/tmp/bccroot/py   # then: --capture-ld-path /tmp/bccroot/lib"
EOF
chmod +x "$KIT/setup.sh"
du -sh "$KIT"
