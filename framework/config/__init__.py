"""The config: its typed schema (schema), whole-config validation before launch (validate)
and the one error a bad config raises (errors)."""
