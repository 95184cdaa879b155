"""Tandem's services: thin gRPC/HTTP processes over the engine in common/."""

import os

# gRPC's fork handlers restart its poller in a child between fork() and exec(); subprocess then
# closes the poller's epoll fd and the child can abort before it execs (grpc/grpc#43055). No
# Tandem process uses gRPC across a fork, so the handlers are off, before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
