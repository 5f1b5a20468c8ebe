"""The `warninglight` command line: a thin shell over the tracer and forensics libraries."""
