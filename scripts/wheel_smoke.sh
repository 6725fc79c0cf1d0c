#!/usr/bin/env bash
# Build the wheel and the sdist of this checkout, install the wheel in a fresh venv (no
# checkout on its path) and try it as a user would: the command, pack, verify, a read through
# the torch-free reader, and the distribution's name and version.
#
# Then the install block of the README and the install guide (marked
# `<!-- test: by=wheel-smoke -->`), as it stands, in the unpacked sdist: a fresh venv, torch
# first, shardio from the source tree.
#
# Usage: scripts/wheel_smoke.sh [PYTHON]   (default: .venv/bin/python, which has setuptools)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
case $python in /*) ;; */*) python=$PWD/$python ;; esac  # the script changes directory
root=$PWD
work=$(mktemp -d "${TMPDIR:-/tmp}/shardio-wheel.XXXXXX")
trap 'rm -rf -- "$work"' EXIT
dist="$work/dist"
mkdir -p "$dist"
# The PEP 517 hooks directly: no isolated build environment to download.
"$python" - "$dist" <<'PY'
import sys
from setuptools import build_meta

out = sys.argv[1]
print("built", build_meta.build_wheel(out), build_meta.build_sdist(out))
PY
wheel=$(ls "$dist"/*.whl)
sdist=$(ls "$dist"/*.tar.gz)
version=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
name=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["name"])')
case "$(basename "$wheel")" in
  "${name//-/_}-$version-"*) ;;
  *) echo "wheel_smoke: $wheel is not $name $version" >&2; exit 1 ;;
esac
# The sdist holds what a build from it needs.
tar -tzf "$sdist" > "$work/sdist.txt"  # (grep -q on a pipe would cut tar off)
grep -q "/pyproject.toml$" "$work/sdist.txt"
grep -q "/shardio/metrics/alerts/" "$work/sdist.txt"
grep -q "/shardio/storage/_fastread.c$" "$work/sdist.txt"  # the compiled read path's source
grep -q "/shardio/storage/_xxhash/xxhash.h$" "$work/sdist.txt"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$wheel"
cd "$work"  # not the checkout: the installed package is the one imported
bin="$work/venv/bin"
[ "$("$bin/shardio" --version)" = "shardio $version" ]
"$bin/pip" show "$name" > "$work/show.txt"
grep -qx "Version: $version" "$work/show.txt"
mkdir -p tree/train/cat tree/train/dog
for i in 1 2 3 4 5 6; do
  head -c $((1000 + i)) /dev/urandom > "tree/train/cat/$i.jpg"
  head -c $((2000 + i)) /dev/urandom > "tree/train/dog/$i.jpg"
done
"$bin/shardio" pack tree out --shard-size 8KiB --no-progress > /dev/null
"$bin/shardio" verify out --no-progress > /dev/null
"$bin/python" - <<'PY'
import pathlib
import sys

import shardio
from shardio import ShardReader

assert "site-packages" in shardio.__file__, shardio.__file__
assert "torch" not in sys.modules
with ShardReader("out") as reader:
    got = {reader.read_sample(i)["__key__"] for i in range(len(reader))}
want = {str(p.relative_to("tree").with_suffix("")) for p in pathlib.Path("tree").rglob("*.jpg")}
assert got == want, (sorted(got), sorted(want))
assert shardio.metrics.alerts_path().is_file()
from shardio.storage import _fastread, opener  # built into the wheel (a C compiler here)

assert opener._fastread is _fastread, "the wheel has no compiled read path"
print(f"wheel_smoke: {len(got)} samples packed, verified and read back from the installed wheel")
PY
# The install blocks of the README and the install guide (marked by=wheel-smoke; the same text,
# so one run), in the unpacked sdist (what a user's checkout holds).
"$python" - "$root/README.md" "$root/docs/install.md" > "$work/install.sh" <<'PY'
import re
import sys

blocks = []
for name in sys.argv[1:]:
    text = open(name, encoding="utf-8").read()
    found = re.findall(r"<!-- test: by=wheel-smoke -->\s*```sh\n(.*?)^```", text, re.S | re.M)
    if not found:
        sys.exit(f"wheel_smoke: {name} has no install block marked by=wheel-smoke")
    blocks += found
if len(set(blocks)) != 1:
    sys.exit("wheel_smoke: the install blocks of README.md and docs/install.md differ")
print(blocks[0])
PY
mkdir "$work/src"
tar -xzf "$sdist" -C "$work/src"
(cd "$work"/src/* && bash -euo pipefail "$work/install.sh" > "$work/install.log" 2>&1) || {
  tail -20 "$work/install.log" >&2
  echo "wheel_smoke: the install block failed in the unpacked sdist" >&2
  exit 1
}
grep -qx "shardio $version" "$work/install.log"
echo "wheel_smoke: $(basename "$wheel") and $(basename "$sdist") OK; the install block works"
