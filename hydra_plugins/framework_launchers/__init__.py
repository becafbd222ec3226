"""The framework's Hydra plugins: Hydra instantiates launchers only from this namespace."""
