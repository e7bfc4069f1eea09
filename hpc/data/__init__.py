"""The training data: sources, tokenising, the draft vocab, regeneration by the target, calibration rows."""
