"""The recorder: per-component health traces written to Parquet while a model trains."""
