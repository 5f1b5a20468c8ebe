"""Judging: the conditions' registry, each component's baseline, the one classifier."""
