#!/usr/bin/env bash
# make gpu-wheels: every wheel aotc and its GPU check need beyond what the device machine has
# (Python 3.12, torch 2.11 + CUDA with its own dependencies, triton 3.6, numpy; no package
# registry), for CPython 3.12 on manylinux x86-64, into .whl/ (ignored by git). The device tool's
# `carry` takes .whl/ along; scripts/gpu-check.sh installs from it with --no-index.
# The versions are the ones `make install` tests here (pyproject's dev extra).
set -euo pipefail
DEST=${1:-.whl}
LIMIT_MIB=60
WANT=(click==8.5.1 sqlite-utils==4.2.1 zstandard==0.25.0 pyyaml==6.0.4 cryptography==50.0.2
      pytest==9.2.0 psutil==7.2.2 transformers==5.19.0 safetensors==0.8.0)
# on the device already (torch's own dependencies, numpy, pip): not carried
HAVE='^(numpy|pip|setuptools|typing_extensions|filelock|fsspec|jinja2|markupsafe|networkx|sympy|mpmath|triton|torch)-'
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$tmp" "${WANT[@]}" 2>&1 | grep -v "^WARNING: Location" || true
ls "$tmp"/*.whl > /dev/null  # nothing downloaded: stop here
rm -rf "$DEST" && mkdir -p "$DEST"
for w in "$tmp"/*.whl; do
    name=$(basename "$w" | tr 'A-Z' 'a-z')
    [[ $name =~ $HAVE ]] || cp "$w" "$DEST/"
done
mib=$(( $(du -sk "$DEST" | cut -f1) / 1024 ))
echo "gpu-wheels: $(ls "$DEST" | wc -l) wheels, ${mib} MiB in $DEST"
if (( mib >= LIMIT_MIB )); then echo "gpu-wheels: over ${LIMIT_MIB} MiB: the device's carry would refuse it" >&2; exit 1; fi
