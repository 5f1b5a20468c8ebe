"""The forensic engine: classify, localise and recommend a rollback from a health trace."""
