"""The one error type a bad config raises: it names the key, the value and the fix."""
from enum import Enum


class ConfigError(ValueError):
    def __init__(self, key: str, value: object, fix: str):
        value = value.value if isinstance(value, Enum) else value  # a schema enum reads as the YAML value
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config error: {key}={value!r}: {fix}")
