"""Per-row features: each folder owns one feature's part of every stage (its options and checks, its per-step
preparation, its op on each execution path, its outputs). sae/: sparse autoencoders and transcoders, the
dictionaries and their file formats."""
