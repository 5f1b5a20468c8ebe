"""Explaining an alarm: onset and root, data roots, ranks, rollback, reference runs, the analysis."""
