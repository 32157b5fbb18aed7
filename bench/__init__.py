"""Benchmarks and fault-injection runs; their recorded results live in `bench/results/`."""
