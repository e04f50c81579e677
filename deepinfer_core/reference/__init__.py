"""Pure-PyTorch implementations of every backend: they run on the CPU and are the oracle."""
