"""Generated gRPC/protobuf stubs of Tandem's contracts (sources: protos/)."""
