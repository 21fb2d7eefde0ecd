"""Throughput/latency harness: llamascope's engine beside its peers, in the same process run (`python -m benchmarks.bench_engine`)."""
