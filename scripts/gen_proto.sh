#!/usr/bin/env bash
# Regenerate ps_server/rpc/proto/ps_pb2.py, ps_pb2.pyi and ps_pb2_grpc.py from
# ps_server/rpc/proto/ps.proto.
# Needs the dev extra (grpcio-tools): .venv/bin/pip install -c constraints.txt -e ".[dev]".
# The generated code checks the protobuf / grpcio runtime versions at import: after regenerating
# with a newer grpcio-tools, raise the protobuf and grpcio lower bounds in pyproject.toml to the
# versions named in the headers of the generated files (printed below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    ps_server/rpc/proto/ps.proto
# generated code is not ours to lint or reformat: mark it for ruff (check and format)
for f in ps_server/rpc/proto/ps_pb2.py ps_server/rpc/proto/ps_pb2.pyi ps_server/rpc/proto/ps_pb2_grpc.py; do
    printf '# ruff: noqa\n# fmt: off\n%s\n' "$(cat "$f")" > "$f"
done
echo "[gen_proto] generated with: $("$PY" -m grpc_tools.protoc --version)"
grep -h "Protobuf Python Version\|GRPC_GENERATED_VERSION = " ps_server/rpc/proto/ps_pb2.py ps_server/rpc/proto/ps_pb2_grpc.py
