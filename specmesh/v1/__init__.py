"""Generated code of the specmesh.v1 wire contract (protos/specmesh/v1/*.proto).

Regenerate with:
    python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/specmesh/v1/*.proto
tests/test_protos.py fails when the committed files differ from a fresh generation.
"""
