"""The run itself: its state (run), the stages that build it in order (builder), the Trainer
with its train_step and loop (trainer), what it carries across checkpoints (state), the LR
schedule (schedule), its measurements and reports (metrics, memory, logger) and the stall
watchdog (watchdog)."""
