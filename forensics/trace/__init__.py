"""The trace on disk: segments, footers, the DuckDB store, checks, SQL, the lr schedule."""
