"""Entry point of rule train (not implemented yet)."""
raise NotImplementedError("train")
