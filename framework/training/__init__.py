"""The run itself: its state (run), the stages that build it in order (builder), the loop
(loop) and rank 0's TensorBoard logging (logger)."""
