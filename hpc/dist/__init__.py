"""torch.distributed plumbing shared by the stream and the trainers: the two planes of one
world (`planes`) and the NCCL rules checked on CPU (`rules`)."""
