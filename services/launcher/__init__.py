"""`tandem up`: a local cluster of real service processes (Redis, prefill, decode, draft, gateway).

    supervisor.py  one child process per service: own log file, SIGTERM -> grace -> SIGKILL
    readiness.py   wait until every child is healthy (gRPC health, gateway /health, registry)
    cluster.py     ClusterSpec -> start_cluster() -> Cluster (the Python API tests use)
    up.py          the `tandem up` command on top of cluster.py
"""
