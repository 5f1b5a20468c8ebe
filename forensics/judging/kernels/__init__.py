"""The classifier's compiled passes (numba), behind the names `judging` calls."""
