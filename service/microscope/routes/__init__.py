"""The microscope's routes (one file per route group; none imports another)."""
