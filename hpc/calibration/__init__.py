"""The confidence head's calibration: maps, their fit, the fold vLLM serves, the report, the stage."""
