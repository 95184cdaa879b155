"""Speculative decoding: proposers (n-gram, remote draft), exact verification, adaptive k."""
