"""Checkpoints: where they live and when one counts as complete (layout), what a config may
change on resume (compat, checked before launch), saving and loading inside the ranks with
torch.distributed.checkpoint (manager)."""
