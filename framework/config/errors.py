"""The one error type a bad config raises: it names the key, the value and the fix."""
from enum import Enum
from typing import Any, Callable, Iterable, Tuple


class ConfigError(ValueError):
    def __init__(self, key: str, value: object, fix: str):
        value = value.value if isinstance(value, Enum) else value  # a schema enum reads as the YAML value
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config error: {key}={value!r}: {fix}")


Rule = Tuple[str, Callable[[Any], bool], str]  # (name, whether its value is allowed, the rule said)


def check_rules(rules: Iterable[Rule], value_of: Callable[[str], Any], key_of: Callable[[str], str]) -> None:
    """A capability's table of rules (an objective's keys, a command's options), each value
    refused alone, by its key: the first that breaks its rule."""
    for name, allowed, rule in rules:
        value = value_of(name)
        if not allowed(value):
            raise ConfigError(key_of(name), value, rule)
