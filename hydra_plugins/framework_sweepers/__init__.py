"""The framework's Hydra sweepers: Hydra instantiates sweepers only from this namespace."""
