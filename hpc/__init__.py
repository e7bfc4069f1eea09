"""dspark-hpc: Slurm-native training and evaluation of DSpark speculative-decoding drafts."""

__version__ = "0.1.0"
