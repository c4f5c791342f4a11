"""Generated protobuf and gRPC modules. Never edit by hand: run `python protos/generate.py`."""
