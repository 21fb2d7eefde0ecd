"""HTTP edge (FastAPI): arrives with the service issue. Empty until then so the package layout is stable."""
