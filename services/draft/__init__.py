"""`tandem draft`: the draft model of speculative decoding as a gRPC service."""
