"""Hand-written CPU kernels (compiled on first use) for the shapes where torch's own are slow."""
