"""The settle's statements: pure builders, each beside its typed parameters and rows."""
