"""Starting ranks: self-launched through the elastic agent (local), joining torchrun's world
(torchrun), the config handed to the ranks (handoff), and a rank's entry (worker)."""
