"""Entry point of rule curate (not implemented yet)."""
raise NotImplementedError("curate")
