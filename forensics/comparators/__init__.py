"""What others would have seen: the loss-spike rule, ZClip, fixed per-tensor rules."""
