"""The administering statements: pure builders, one module per plane and verb."""
