"""The command line's overrides, checked before Hydra composes them, where what Hydra would
make of them is not what was asked: a switch given a number, a key added twice."""
from typing import List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser

from framework.config.errors import ConfigError
from framework.config.schema import field_type


def check_overrides(overrides: Sequence[str]) -> None:
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o])
    added: List[str] = []
    for override in parsed:
        key = override.key_or_group
        if override.is_add():
            # Hydra merges a second `+KEY=...` into the first: two mixture sources of one name train as one
            if key in added:
                raise ConfigError(key, override.value(), "is added twice (+); give it once (a mixture's sources "
                                                         "each under a name of their own)")
            added.append(key)
        kind = field_type(key)
        nullable = kind == Optional[bool]
        if (kind is bool or nullable) and not override.is_sweep_override() and not override.is_delete():
            # OmegaConf takes any non-zero number as true (trainer.memory_snapshot=2)
            value = override.value()
            if not isinstance(value, bool) and not (value is None and nullable):
                raise ConfigError(key, value, "must be true or false" + (", or null" if nullable else ""))
