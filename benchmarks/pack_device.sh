#!/usr/bin/env bash
# Build .device/ here, for the GPU machine the device tool lends (see DEVELOPERS.md): its
# image has Python 3.12 and torch but not Ray, and a call carries at most 64 MiB. Ray's
# wheel (79 MB) travels unpacked as an xz tarball without its Java jars, dashboard
# front end, RLlib, Serve and LLM libraries; jsonschema and its needs as wheels.
#   benchmarks/pack_device.sh        then: run(command=".ci/device-gpu", carry=[".device"])
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf .device && mkdir -p .device "$work/site"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work" "ray==${RAY_VERSION:-2.60.0}" \
  jsonschema jsonschema-specifications referencing rpds-py
mv "$work"/jsonschema*.whl "$work"/referencing*.whl "$work"/rpds_py*.whl .device/
(cd "$work/site" && unzip -q "$work"/ray-*.whl)
(cd "$work/site" && rm -rf ray/jars ray/dashboard/client ray/rllib ray/serve ray/llm)
tar -C "$work/site" -cf - . | xz -T0 -9 > .device/ray.tar.xz
du -ch .device/* | tail -1
